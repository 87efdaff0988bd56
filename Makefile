# Every target that needs PostgreSQL finds or starts one the same way
# (scripts/postgres-env.sh): POSTGRES_DSN, else 127.0.0.1:5432, else a local
# installation, else Docker.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PG_ENV := eval "$$(scripts/postgres-env.sh)"
GO_TEST_FLAGS ?= -race -count=1
BENCH_FLAGS ?=
# The go tool skips directories starting with "_" in ./... patterns.
# Examples with a go.mod of their own (the relays, which need broker
# clients the library does not depend on) are modules apart: left out of
# EXAMPLES, built and tested from their own directory.
BROKER_MODULES := $(patsubst %/go.mod,%,$(wildcard _examples/*/go.mod))
# Modules of the library's own that depend on what the library must not
# (pgoutboxprom: client_golang; pgoutboxotel: the OpenTelemetry SDK;
# tests/migrations: goose and golang-migrate, which apply the rendered
# migrations; tests/drivers: lib/pq before v1.11, a database/sql driver
# without arrays; pgoutboxtest/dockerpg: the Docker client; tests/browser:
# chromedp, driving chromium), tested like the
# library, under -race. To add a module: create its go.mod requiring the
# main module at RELEASE_VERSION (no replace), `go work use ./dir`, and add
# it here (docs/versioning.md).
LIB_MODULES := pgoutboxprom pgoutboxotel tests/migrations tests/drivers pkg/pgoutbox/pgoutboxtest/dockerpg tests/browser
# Every module but the root, each listed in go.work, so builds in the
# repository use the working tree; `make modules` builds each without the
# workspace against the tree served as RELEASE_VERSION, the version its
# go.mod requires and the next tag of the main module.
MODULES := $(LIB_MODULES) $(BROKER_MODULES) tests/bench
RELEASE_VERSION := v0.1.0
EXAMPLES := $(patsubst %/,./%,$(filter-out $(addsuffix /,$(BROKER_MODULES)),$(wildcard _examples/*/)))

.PHONY: demo examples test test-quick lint modules fuzz bench bench-relay bench-compare bench-soak ui-screenshots

## demo: run _examples/basic (an order and its message in one transaction, consumed by a router)
demo:
	@$(PG_ENV); go run ./_examples/basic

## examples: build every example under _examples, those with a go.mod of their own too
examples:
	@for d in $(EXAMPLES); do echo "go build $$d"; go build -o /dev/null $$d; done
	@for d in $(BROKER_MODULES); do echo "go build in $$d"; (cd $$d && go build -o /dev/null .); done

## test: every step below, all run even when one fails, then the list of the failed ones: lint, modules, the tests under -race, each LIB module, the relay examples' broker tests, the reconnect test on its own
# The broker tests run without -race: watermill-amqp v3.0.2 races in its own
# reconnect code (ConnectionWrapper.IsConnected); the relay itself runs
# under -race in ./tests. They skip where the broker is unreachable,
# unless PGOUTBOX_REQUIRE_BROKERS is set (CI sets it).
# (without -race: Watermill's TestReconnect appends to a slice from one
# goroutine and reads it from another, a race in the suite's own code; our
# code runs under -race in the first step, universal suite included).
# With a restart command the step fails unless TestReconnect passed: a skip
# or a -run matching nothing would otherwise look like success.
test:
	@$(PG_ENV); failed=(); \
	step() { local name=$$1; shift; echo "=== $$name"; if ! "$$@"; then failed+=("$$name"); echo "=== FAILED: $$name"; fi; }; \
	in_dir() { (cd "$$1" && shift && "$$@"); }; \
	reconnect() { \
		go test -count=1 -timeout 5m -run '^TestReconnect$$' -v ./tests/ \
			| awk '/^--- PASS: TestReconnect / { passed = 1 } \
				/^(=== RUN|--- |PASS|FAIL|ok|panic)|received in bulk read|missing/ { print; next } \
				/^(    |\t)/ { print; next } \
				/^error on publish/ { if (errs++ < 5) print } \
				END { if (errs > 5) print "(" errs - 5 " more publish errors, retried, not shown)"; \
					if (!passed) { print "--- TestReconnect did not pass (failed, skipped or not run): see the lines above"; exit 1 } }'; \
	}; \
	step lint $(MAKE) --no-print-directory lint; \
	step modules $(MAKE) --no-print-directory modules; \
	step "go test ./..." env -u PGOUTBOX_TEST_RESTART_CMD go test $(GO_TEST_FLAGS) -timeout 20m ./... $(EXAMPLES); \
	for m in $(LIB_MODULES); do \
		step "$$m (a module of its own)" in_dir $$m go test $(GO_TEST_FLAGS) -timeout 5m ./...; \
	done; \
	for m in $(BROKER_MODULES); do \
		step "$$m (a module of its own: relay tests against a real broker)" in_dir $$m go test -count=1 -timeout 5m ./...; \
	done; \
	if [ -n "$${PGOUTBOX_TEST_RESTART_CMD:-}" ]; then \
		step "TestReconnect (restarts PostgreSQL with: $$PGOUTBOX_TEST_RESTART_CMD)" reconnect; \
	else \
		echo "--- TestReconnect skipped: set PGOUTBOX_TEST_RESTART_CMD to a command that restarts PostgreSQL (CI requires it)"; \
	fi; \
	if [ $${#failed[@]} -gt 0 ]; then \
		echo "make test: $${#failed[@]} step(s) failed:"; printf '  - %s\n' "$${failed[@]}"; exit 1; \
	fi; \
	echo "make test: every step passed"

## modules: build and vet every module but the root without go.work, against the working tree served as RELEASE_VERSION (what users resolve once it is tagged)
modules:
	@listed=$$(go work edit -json | sed -n 's/.*"DiskPath": "\.\/\(.*\)".*/\1/p' | sort); \
	want=$$(printf '%s\n' $(MODULES) | sort); \
	if [ "$$listed" != "$$want" ]; then \
		echo "go.work lists: $$(echo $$listed); the Makefile's MODULES: $$(echo $$want); make them the same (go work use ./dir, docs/versioning.md)"; exit 1; \
	fi; \
	untracked=$$(git ls-files --cached --others --exclude-standard '*go.mod' | grep -v '^go.mod$$' | sed 's|/go.mod$$||' | sort); \
	if [ "$$untracked" != "$$want" ]; then \
		echo "modules in the tree: $$(echo $$untracked); the Makefile's MODULES: $$(echo $$want); add the new one to LIB_MODULES and go.work"; exit 1; \
	fi
	@if ! go work edit -json | tr -d ' \n\t' | grep -q '"Old":{"Path":"github.com/pgoutbox/watermill-pgoutbox","Version":"$(RELEASE_VERSION)"}'; then \
		echo "go.work must replace github.com/pgoutbox/watermill-pgoutbox $(RELEASE_VERSION) by ./ (the version the modules require)"; exit 1; \
	fi
	@scripts/check-modules.sh $(RELEASE_VERSION) $(MODULES)

## test-quick: the library packages' own tests (seconds), not the integration, suite and fault tests
test-quick:
	@$(PG_ENV); go test $(GO_TEST_FLAGS) ./pkg/...; \
	for m in $(LIB_MODULES); do (cd $$m && go test $(GO_TEST_FLAGS) ./...); done

## fuzz: run each fuzz target for FUZZTIME (10s); make test runs their seed corpus as plain tests
FUZZTIME ?= 10s
fuzz:
	@for pkg in $$(go list ./pkg/...); do \
		for target in $$(go test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
			echo "--- $$target ($$pkg)"; \
			go test -run '^$$' -fuzz "^$$target\$$" -fuzztime $(FUZZTIME) $$pkg; \
		done; \
	done

## lint: gofmt and go vet
lint:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	go vet ./... $(EXAMPLES)
	@for m in $(LIB_MODULES); do echo "go vet in $$m"; (cd $$m && go vet ./...); done

## bench: pgoutbox vs. a hand-written pgx floor vs. watermill-sql (tests/bench, its own module); e.g. BENCH_FLAGS="-repeat 1 -scale 0.1"
bench:
	@$(PG_ENV); cd tests/bench && go run . $(BENCH_FLAGS)
	@$(MAKE) --no-print-directory bench-relay

## bench-soak: steady load for minutes (SOAK_SCENARIOS; pgoutbox and pgoutbox-lease): latency, backlog, table size and dead tuples per window; needs autovacuum on (eval "$$(scripts/soak-cluster.sh)" first); e.g. SOAK_FLAGS="-soak-duration 60s"
SOAK_SCENARIOS ?= soak,soak-blocked,soak-timer,soak-blocked-timer
bench-soak:
	@$(PG_ENV); cd tests/bench && go run . -repeat 1 -systems pgoutbox,pgoutbox-lease -scenarios $(SOAK_SCENARIOS) $(SOAK_FLAGS)

## bench-relay: the relay to each broker (RabbitMQ, NATS JetStream) next to a direct publish to it, same confirmations and concurrency
bench-relay:
	@$(PG_ENV); for m in $(BROKER_MODULES); do \
		echo "--- $$m"; \
		(cd $$m && go test -run '^$$' -bench . -benchtime $(or $(RELAY_BENCH_N),20000)x -count $(or $(RELAY_BENCH_COUNT),3) .) | grep -E '^(Benchmark|ok|FAIL)'; \
	done

## bench-compare: pgoutbox at BASE (a commit) vs the working tree, side by side, medians; e.g. make bench-compare BASE=35b3c5e (SYSTEM=pgoutbox-lease or another pgoutbox system of the bench)
# (A comma-separated default inside $(or ...) would be split into its
# arguments: the list is a variable of its own.)
SCENARIOS ?= drain-1,drain-16,drain-1m,latency-1,latency-16
bench-compare:
	@$(PG_ENV); scripts/bench-compare.sh $(BASE) $(or $(ROUNDS),3) $(SCENARIOS) $(or $(SCALE),5) $(or $(SYSTEM),pgoutbox)

## ui-screenshots: regenerate docs/images/ui-*.png, the operator page in headless chromium (tests/browser)
ui-screenshots:
	@$(PG_ENV); cd tests/browser && PGOUTBOX_REQUIRE_BROWSER=1 PGOUTBOX_SCREENSHOTS=$(CURDIR)/docs/images go test -count=1 -run '^TestScreenshots$$' -v . | grep -E '^(---|ok|FAIL|panic)|Error'
