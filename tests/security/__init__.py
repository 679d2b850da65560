"""Attack tests: each sends what an attacker would and asserts the attack fails."""
