// Command bench measures pgoutbox against the floor of its lease pattern
// (hand-written pgx, "raw") and against watermill-sql's queue schema, on the
// same PostgreSQL, in one process run:
//
//	go run . [-repeat 3] [-scenarios publish-1,drain-16] [-systems pgoutbox,raw] [-json]
//
// It lives in its own module so the comparison's dependencies
// (watermill-sql, lib/pq, ...) stay out of the library's go.mod.
//
// Systems: "pgoutbox" (the library, through a Watermill Router), "raw" (the
// same table and the plain claim statement driven by one hand-written loop:
// the floor of the lease pattern, committing synchronously), "raw-async"
// (the same loop with pgoutbox's asynchronous-commit condition) and
// "watermill-sql" (v4 queue schema with delete on ack, through a Router). Scenarios: publish-1, publish-100, drain-1,
// drain-16, latency-1, latency-16, timers and drain-1m; scenarios.go says
// what each measures. The soak scenarios (soak.go: steady load for minutes,
// with the table's size and dead tuples per window) run only when named. -scale 0.1 makes a quick run; -sync-commit makes the
// consumers' bookkeeping writes wait for the WAL flush.
//
// Every scenario run gets a fresh PostgreSQL schema (dropped afterwards) in
// a database of its own, "pgoutbox_bench", created if missing. Runs are
// ordered repeat → scenario → system, so the systems of one scenario are
// measured side by side and slow drifts of the machine (checkpoints,
// autovacuum, a noisy neighbour) spread over all of them; each figure
// reported is the median over the repeats.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

const (
	benchDB = "pgoutbox_bench"
	// poolSize bounds the shared pool every system's subscriber uses. It is
	// above what any consumer needs at once (claims, ack flushes, renewals,
	// the timers scenario's per-message query), so no system waits for a
	// connection.
	poolSize = 8
)

type options struct {
	repeat       int
	scenarios    []string
	systems      []string
	dsn          string
	json         bool
	scale        float64
	backlogLarge int
	syncCommit   bool
	cpuProfile   string
	memProfile   string
	publishCost  int // -publish-cost: transactions per case and round; 0: run the scenarios
	// publishCostSize: -publish-cost-size, the messages per transaction of
	// the cases to run; 0: all.
	publishCostSize int
	soak            soakOptions
	// rotationWindow: -rotation-window, pgoutbox-ring's RotationWindow.
	rotationWindow time.Duration
}

// bench is what every run shares: the pool, the connection settings and the
// options.
type bench struct {
	opts     options
	pool     *pgxpool.Pool
	connCfg  *pgx.ConnConfig
	logger   watermill.LoggerAdapter
	progress io.Writer
	seq      int
	// postmaster is the server's postmaster pid when the server runs on
	// this machine (serverCPU), else 0.
	postmaster int
}

func main() {
	opts, err := parseFlags()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, opts); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func parseFlags() (options, error) {
	var o options
	var scenarioList, systemList string
	defaultDSN := os.Getenv("POSTGRES_DSN")
	if defaultDSN == "" {
		defaultDSN = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	flag.IntVar(&o.repeat, "repeat", 3, "run every scenario N times and report the median of each figure")
	flag.StringVar(&scenarioList, "scenarios", strings.Join(scenarioNames(), ","), "comma-separated scenarios to run; the soak scenarios ("+
		strings.Join(knownScenarioNames()[len(scenarioNames()):], ", ")+") only when named")
	flag.StringVar(&systemList, "systems", strings.Join(systemNames(), ","), "comma-separated systems to measure")
	flag.StringVar(&o.dsn, "dsn", defaultDSN, "PostgreSQL DSN (default $POSTGRES_DSN); the benchmark works in database "+benchDB+" on that server and creates it if missing")
	flag.BoolVar(&o.json, "json", false, "print one JSON object per system and scenario on stdout (the table then goes to stderr)")
	flag.Float64Var(&o.scale, "scale", 1, "multiply every message count (including -backlog-large) by this factor, e.g. 0.1 for a quick run")
	flag.IntVar(&o.backlogLarge, "backlog-large", 1_000_000, "backlog size of the drain-1m scenario")
	flag.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the whole run to this file (go tool pprof)")
	flag.StringVar(&o.memProfile, "memprofile", "", "write an allocation profile of the whole run to this file at its end (go tool pprof -sample_index=alloc_objects)")
	flag.BoolVar(&o.syncCommit, "sync-commit", false, "make pgoutbox's claims and acks wait for the WAL flush (SubscriberConfig.SynchronousCommit; default: asynchronous, pgoutbox's default). raw always waits, raw-async never does; watermill-sql always waits")
	flag.IntVar(&o.publishCost, "publish-cost", 0, "instead of the scenarios, break a Publish's cost down step by step (tests/bench/publish_cost.go): N transactions per case and round, -repeat rounds")
	flag.IntVar(&o.publishCostSize, "publish-cost-size", 0, "with -publish-cost, only the cases of this many messages per transaction (1 or 100; 0: both)")
	flag.DurationVar(&o.soak.duration, "soak-duration", 5*time.Minute, "how long each soak scenario publishes")
	flag.Float64Var(&o.soak.rate, "soak-rate", 2000, "messages per second of the soak scenarios, in all")
	flag.IntVar(&o.soak.publishers, "soak-publishers", 16, "publishers of the soak scenarios, each on its own connection, one message per transaction")
	flag.DurationVar(&o.soak.window, "soak-window", 10*time.Second, "the soak scenarios print one line per window")
	flag.DurationVar(&o.rotationWindow, "rotation-window", 0, "SubscriberConfig.RotationWindow of pgoutbox-ring (0: the library's default)")
	flag.BoolVar(&o.soak.noAutovacuum, "soak-allow-no-autovacuum", false, "run the soak scenarios on a server with autovacuum off (they refuse to by default)")
	flag.Parse()

	var problems []string
	if o.repeat < 1 {
		problems = append(problems, "-repeat must be at least 1")
	}
	if o.scale <= 0 {
		problems = append(problems, "-scale must be positive")
	}
	if o.backlogLarge < 1 {
		problems = append(problems, "-backlog-large must be at least 1")
	}
	var err error
	problems = append(problems, o.soak.problems()...)
	if o.scenarios, err = pick("scenario", scenarioList, knownScenarioNames()); err != nil {
		problems = append(problems, err.Error())
	}
	if o.systems, err = pick("system", systemList, systemNames()); err != nil {
		problems = append(problems, err.Error())
	}
	if len(problems) > 0 {
		return o, errors.New(strings.Join(problems, "; "))
	}
	return o, nil
}

// pick splits a comma-separated list and checks every name against known.
// The result keeps the canonical order of known, not the order given, so
// the output table always reads the same way.
func pick(what, list string, known []string) ([]string, error) {
	want := map[string]bool{}
	for _, s := range strings.Split(list, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if !slices.Contains(known, s) {
			return nil, fmt.Errorf("unknown %s %q (known: %s)", what, s, strings.Join(known, ", "))
		}
		want[s] = true
	}
	var out []string
	for _, k := range known {
		if want[k] {
			out = append(out, k)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no %s selected", what)
	}
	return out, nil
}

// count scales a message count, keeping at least one message.
func (b *bench) count(n int) int {
	return max(1, int(math.Round(float64(n)*b.opts.scale)))
}

func run(ctx context.Context, opts options) error {
	if opts.cpuProfile != "" {
		f, err := os.Create(opts.cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	if opts.memProfile != "" {
		runtime.MemProfileRate = 4096
		defer func() {
			if f, err := os.Create(opts.memProfile); err == nil {
				_ = pprof.Lookup("allocs").WriteTo(f, 0)
				f.Close()
			}
		}()
	}
	b := &bench{
		opts: opts,
		// Errors only: a benchmark run must stay quiet unless something breaks.
		logger:   pgoutbox.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))), // skips disabled levels before building fields, as users of the README do
		progress: os.Stderr,
	}
	out := io.Writer(os.Stdout)
	if opts.json {
		out = os.Stderr // stdout carries only the JSON lines
	}
	if err := b.connect(ctx); err != nil {
		return err
	}
	defer b.pool.Close()
	if err := b.printConditions(ctx, out); err != nil {
		return err
	}
	if err := b.checkSoak(ctx, out); err != nil {
		return err
	}
	if err := b.dropLeftovers(ctx); err != nil {
		return err
	}
	if opts.publishCost > 0 {
		return runPublishCost(ctx, b, out, opts.publishCost, opts.repeat)
	}

	type key struct{ scenario, system string }
	results := map[key][]result{}
	failures := map[key][]string{}
	var plan []key
	for _, sc := range opts.scenarios {
		for _, sys := range opts.systems {
			if scenarioByName(sc).takes(sys) {
				plan = append(plan, key{sc, sys})
			}
		}
	}
	if len(plan) == 0 {
		return errors.New("the selected scenarios and systems have no combination in common")
	}
	noise := b.monitorNoise(ctx)
	started := time.Now()
	for r := 1; r <= opts.repeat; r++ {
		for _, k := range plan {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			t0 := time.Now()
			res, err := b.runOne(ctx, scenarioByName(k.scenario), systemByName(k.system))
			if err != nil {
				failures[k] = append(failures[k], err.Error())
				fmt.Fprintf(b.progress, "[%d/%d] %-12s %-14s FAILED: %v\n", r, opts.repeat, k.scenario, k.system, err)
				continue
			}
			results[k] = append(results[k], res)
			fmt.Fprintf(b.progress, "[%d/%d] %-12s %-14s %s  (%.1fs)\n",
				r, opts.repeat, k.scenario, k.system, res.figures(), time.Since(t0).Seconds())
		}
	}
	fmt.Fprintf(b.progress, "total time %s\n", time.Since(started).Round(time.Second))

	var rows []row
	for _, k := range plan {
		rs := results[k]
		rw := row{System: k.system, Scenario: k.scenario, Runs: len(rs)}
		if len(rs) > 0 {
			pick := func(f func(result) float64) []float64 {
				xs := make([]float64, len(rs))
				for i, r := range rs {
					xs[i] = f(r)
				}
				return xs
			}
			rw.MsgsPerS = round(median(pick(func(r result) float64 { return r.msgsPerS })), 1)
			rw.P50ms = round(median(pick(func(r result) float64 { return r.p50ms })), 2)
			rw.P99ms = round(median(pick(func(r result) float64 { return r.p99ms })), 2)
			rw.ServerUs = round(median(pick(func(r result) float64 { return r.serverUs })), 1)
			rw.ClientUs = round(median(pick(func(r result) float64 { return r.clientUs })), 1)
			rw.Note = rs[0].note
		}
		if f := failures[k]; len(f) > 0 {
			rw.Note = joinNote(rw.Note, fmt.Sprintf("FAILED %d of %d runs: %s", len(f), opts.repeat, f[0]))
		}
		rows = append(rows, rw)
	}
	printTable(out, rows)
	noise.report(out)
	if opts.json {
		enc := json.NewEncoder(os.Stdout)
		for _, rw := range rows {
			if err := enc.Encode(rw); err != nil {
				return err
			}
		}
	}
	if len(failures) > 0 {
		return fmt.Errorf("%d system/scenario combinations had failed runs (see above)", len(failures))
	}
	return nil
}

// row is one line of the output; its JSON form is the machine-readable
// result, with every field present (0 where a figure does not apply).
type row struct {
	System   string  `json:"system"`
	Scenario string  `json:"scenario"`
	MsgsPerS float64 `json:"msgs_per_s"`
	P50ms    float64 `json:"p50_ms"`
	P99ms    float64 `json:"p99_ms"`
	// CPU µs per message of the server and of the bench (drains; 0: not
	// measured, -1: the server is not on this machine).
	ServerUs float64 `json:"server_us_per_msg"`
	ClientUs float64 `json:"client_us_per_msg"`
	Note     string  `json:"note"`
	Runs     int     `json:"runs"`
}

func round(x float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(x*p) / p
}

func printTable(w io.Writer, rows []row) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "system\tscenario\tmsgs/s\tp50 ms\tp99 ms\tserver µs/msg\tclient µs/msg\t\tnote")
	num := func(x float64, digits int) string {
		if x == 0 {
			return "-"
		}
		return fmt.Sprintf("%.*f", digits, x)
	}
	for _, r := range rows {
		// The note is left-aligned after an empty column, so AlignRight
		// only affects the figures.
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t\t%s\n", r.System, r.Scenario,
			num(r.MsgsPerS, 1), num(r.P50ms, 2), num(r.P99ms, 2), num(max(r.ServerUs, 0), 1), num(max(r.ClientUs, 0), 1), r.Note)
	}
	fmt.Fprintln(w)
	_ = tw.Flush()
}

// runOne runs one scenario for one system in a fresh schema and drops the
// schema afterwards, whatever happened.
func (b *bench) runOne(ctx context.Context, sc *scenario, sys system) (result, error) {
	b.seq++
	schemaName := strings.NewReplacer("-", "_").Replace(fmt.Sprintf("bench_%s_%s_%d", sys.name(), sc.name, b.seq))
	inst, err := sys.newInstance(ctx, b, schemaName)
	defer func() {
		// Background: an interrupted run still cleans up after itself.
		dctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := b.pool.Exec(dctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schemaName}.Sanitize()+` CASCADE`); err != nil {
			fmt.Fprintf(b.progress, "drop schema %s: %v\n", schemaName, err)
		}
	}()
	if err != nil {
		return result{}, fmt.Errorf("set up: %w", err)
	}
	return sc.run(ctx, b, inst)
}
