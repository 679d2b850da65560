module tokenbus.local/tools/promtool

go 1.26.0

tool github.com/prometheus/prometheus/cmd/promtool

require github.com/prometheus/prometheus v0.316.0
