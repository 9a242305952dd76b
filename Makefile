# Convenience targets; the README's two commands are scripts/demo.sh and scripts/test.sh.
PY := .venv/bin/python

.PHONY: setup test demo bench generate check-generated dashboard-images record-demo record-first-run

setup:
	bash scripts/setup.sh

test:
	bash scripts/test.sh

demo:
	bash scripts/demo.sh

bench: setup
	.venv/bin/mooncake-lookout bench --out out/bench

# Regenerate every generated file: dashboards + alert rules, the chart's values schema, then every generated
# block of the docs (README and docs tables, the package graph of docs/architecture.md).
generate: setup
	$(PY) dashboards/generate.py
	$(PY) helm/tools/values_schema.py
	$(PY) helm/tools/failover_doc.py
	$(PY) -m mooncake_lookout.connector.cli.docs

check-generated: setup
	$(PY) dashboards/generate.py --check
	$(PY) helm/tools/values_schema.py --check
	$(PY) helm/tools/failover_doc.py --check
	$(PY) -m mooncake_lookout.connector.cli.docs --check
	promtool check rules dashboards/alerts.rules.yaml
	promtool test rules dashboards/alerts.test.yaml

# Pictures of the dashboards, drawn from a real Prometheus scraping a real workload (~75 s).
dashboard-images: setup
	$(PY) dashboards/render.py --out dashboards/images --seconds 45

# What the README shows a newcomer, recorded with its date, commit and load (then every doc block regenerated):
# the demo script's whole output (docs/bench/demo.txt), and a first run from a fresh clone (docs/bench/first-run.json).
record-demo:
	$(PY) -m mooncake_lookout.connector.cli.record demo

record-first-run:
	$(PY) -m mooncake_lookout.connector.cli.record first-run
