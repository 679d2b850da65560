"""Local Apache Kafka for laptops and CI: Maven-resolved, run on the JVM, no Docker."""
