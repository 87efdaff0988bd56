package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// topic is the one topic every scenario uses; each run has its own table.
const topic = "bench"

// payloadSize is the body of every message, a typical small domain event.
const payloadSize = 200

// system is one way of running an outbox: pgoutbox, the raw floor, or
// watermill-sql.
type system interface {
	name() string
	// newInstance creates the system's table in a new schema of that name.
	newInstance(ctx context.Context, b *bench, schema string) (instance, error)
}

// instance is a system on one fresh table, for one scenario run.
type instance interface {
	// table is the quoted, schema-qualified name of the message table.
	table() string
	// publish writes msgs to topic inside t; it never commits.
	publish(ctx context.Context, t pgx.Tx, msgs []*message.Message) error
	// loadBacklog inserts n valid messages of payloadSize bytes with one
	// INSERT ... SELECT FROM generate_series: fast, and the same for every
	// system, so only consumption is measured.
	loadBacklog(ctx context.Context, n int, payload []byte) error
	// consumer prepares a consumer (connections, router) without starting
	// it, so set-up cost stays outside the timed part.
	consumer(ctx context.Context, cfg consumeConfig) (consumer, error)
}

type consumeConfig struct {
	maxInFlight int
	// handle runs at the start of each message's handler, with the message
	// UUID, before the message is acked; an error fails the run.
	handle func(uuid string) error
	// acks is how many acks the run expects; waitAcked waits for them.
	acks int
	// timers: the pgoutbox subscriber of the timers scenario polls every
	// 10s with a 30s lease, so only its timer planning can be on time.
	timers bool
	// group: the pgoutbox consumer group (the consumer group scenarios).
	group string
}

type consumer interface {
	start(ctx context.Context) error
	// waitAcked blocks until cfg.acks acks are written to the database
	// (rows deleted), not merely given to the subscriber.
	waitAcked(ctx context.Context, timeout time.Duration) error
	// failed is closed when the consumer broke; err says why.
	failed() <-chan struct{}
	err() error
	close() error
}

// failure records the first error of a consumer and signals it.
type failure struct {
	once  sync.Once
	ch    chan struct{}
	first error
}

func newFailure() *failure { return &failure{ch: make(chan struct{})} }

func (f *failure) fail(err error) {
	f.once.Do(func() {
		f.first = err
		close(f.ch)
	})
}

func (f *failure) failed() <-chan struct{} { return f.ch }

func (f *failure) err() error {
	select {
	case <-f.ch:
		return f.first
	default:
		return nil
	}
}

type scenario struct {
	name string
	// systems that take part; nil means all.
	systems []string
	// explicit scenarios run only when -scenarios names them (the soaks,
	// minutes each; soak.go).
	explicit bool
	run      func(ctx context.Context, b *bench, inst instance) (result, error)
}

func (s *scenario) takes(sys string) bool {
	if s.systems == nil { // the variants only where a scenario names them
		return sys != rawInsertName && sys != pgoutboxNotifyEachName && sys != pgoutboxLeaseName && sys != pgoutboxTxName && sys != rotatingName && sys != generationsName && sys != pgoutboxRingName && !strings.HasPrefix(sys, rawHeldName)
	}
	return slices.Contains(s.systems, sys)
}

// drainSystems are the systems of drain-16: all but the publish floor, and
// the held-transaction ceiling.
var drainSystems = []string{"pgoutbox", pgoutboxLeaseName, pgoutboxTxName, pgoutboxArrivalsName, pgoutboxArrivalsLease, "raw", "raw-async", rawHeldName, rawHeldName + "-async", "watermill-sql"}

// pathSystems are pgoutbox on its default path (ClaimAuto) and on leases
// alone, with watermill-sql: the scenarios where the held path may differ.
var pathSystems = []string{"pgoutbox", pgoutboxLeaseName, pgoutboxArrivalsName, "raw", "raw-async", "watermill-sql"}

// publishSystems are the systems of the concurrent publish scenarios:
// pgoutbox (and as it was, notifying in every transaction), the floor (a
// bare INSERT, no NOTIFY) and watermill-sql.
var publishSystems = []string{"pgoutbox", pgoutboxArrivalsName, pgoutboxNotifyEachName, rawInsertName, "watermill-sql"}

// scenarios in output order.
var scenarios = []*scenario{
	{name: "publish-1", run: publishScenario(1)},
	{name: "publish-100", run: publishScenario(100)},
	{name: "publish-tx-1", systems: publishSystems, run: concurrentPublishScenario(1)},
	{name: "publish-tx-16", systems: publishSystems, run: concurrentPublishScenario(16)},
	{name: "publish-100-g1", systems: []string{"pgoutbox", pgoutboxArrivalsName}, run: groupPublishScenario(1)},
	{name: "publish-100-g5", systems: []string{"pgoutbox", pgoutboxArrivalsName}, run: groupPublishScenario(5)},
	{name: "drain-3groups", systems: []string{"pgoutbox", pgoutboxArrivalsName}, run: groupDrainScenario(3)},
	{name: "latency-busy", systems: []string{"pgoutbox", pgoutboxNotifyEachName, "watermill-sql"}, run: busyLatencyScenario},
	{name: "drain-1", systems: pathSystems, run: drainScenario(false, 1)},
	{name: "drain-16", systems: drainSystems, run: drainScenario(false, 16)},
	{name: "latency-1", systems: pathSystems, run: latencyScenario(1)},
	{name: "latency-16", systems: pathSystems, run: latencyScenario(16)},
	{name: "timers", systems: []string{"pgoutbox", pgoutboxLeaseName}, run: timersScenario},
	{name: "slow-1-in-1000", systems: []string{"pgoutbox", pgoutboxLeaseName}, run: slowOneInThousandScenario},
	{name: "drain-1m", systems: []string{"pgoutbox", "raw", "raw-async"}, run: drainScenario(true, 16)},
	{name: "keyed-100-16", systems: []string{"pgoutbox"}, run: keyedDrainScenario(100, 16)},
	// Fewer keys than handlers: every key is in flight most of the time,
	// so each key's next message waits for its ack and the next claim.
	{name: "keyed-8-16", systems: []string{"pgoutbox"}, run: keyedDrainScenario(8, 16)},
	{name: "unkeyed-work-16", systems: []string{"pgoutbox"}, run: keyedDrainScenario(0, 16)},
	{name: "unkeyed-work-1", systems: []string{"pgoutbox"}, run: keyedDrainScenario(0, 1)},
}

// scenarioNames are the scenarios run by default; knownScenarioNames adds
// the explicit ones.
func scenarioNames() []string {
	var out []string
	for _, s := range scenarios {
		out = append(out, s.name)
	}
	return out
}

func knownScenarioNames() []string {
	out := scenarioNames()
	for _, s := range explicitScenarios {
		out = append(out, s.name)
	}
	return out
}

func scenarioByName(name string) *scenario {
	for _, s := range append(slices.Clip(scenarios), explicitScenarios...) {
		if s.name == name {
			return s
		}
	}
	panic("unknown scenario " + name)
}

var systems = []system{pgoutboxSystem{}, pgoutboxSystem{notifyEach: true}, pgoutboxSystem{lease: true}, pgoutboxSystem{txHandler: true}, rawSystem{}, rawSystem{async: true}, rawSystem{insertOnly: true},
	rawSystem{held: true}, rawSystem{held: true, async: true}, watermillSQLSystem{}, rotatingSystem{}, generationsSystem{}, pgoutboxSystem{rotating: true},
	pgoutboxSystem{arrivals: true}, pgoutboxSystem{arrivals: true, lease: true}}

func systemNames() []string {
	var out []string
	for _, s := range systems {
		out = append(out, s.name())
	}
	return out
}

func systemByName(name string) system {
	for _, s := range systems {
		if s.name() == name {
			return s
		}
	}
	panic("unknown system " + name)
}

func newPayload() []byte {
	return []byte(strings.Repeat("x", payloadSize))
}

func newMessages(n int, payload []byte) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
	}
	return msgs
}

// inFlightNote marks the rows where a system cannot honour MaxInFlight, so
// nobody reads its -16 figure as a concurrent run.
func inFlightNote(inst instance, maxInFlight int) string {
	if maxInFlight <= 1 {
		return ""
	}
	switch inst.(type) {
	case *watermillSQLInstance:
		return "no in-flight setting"
	case *rawInstance:
		return "floor loop: claims 100, ignores MaxInFlight"
	}
	return ""
}

// commitNote says how a drain's bookkeeping writes commit where that
// differs from the header's setting: it explains much of the gap between
// the systems on a disk where a WAL flush is expensive.
func commitNote(b *bench, inst instance) string {
	if _, ok := inst.(*watermillSQLInstance); ok && !b.opts.syncCommit {
		return "acks commit synchronously (no option)"
	}
	return ""
}

// countRows counts the rows of inst's table, outside any timed part.
func countRows(ctx context.Context, b *bench, inst instance) (int64, error) {
	if c, ok := inst.(interface {
		countRows(context.Context) (int64, error)
	}); ok {
		return c.countRows(ctx)
	}
	var n int64
	err := b.pool.QueryRow(ctx, `SELECT count(*) FROM `+inst.table()).Scan(&n)
	return n, err
}

// expectRows fails the run when the table does not hold want rows: a
// benchmark of a system that lost or kept messages measures nothing.
func expectRows(ctx context.Context, b *bench, inst instance, want int64, when string) error {
	n, err := countRows(ctx, b, inst)
	if err != nil {
		return fmt.Errorf("count rows %s: %w", when, err)
	}
	if n != want {
		return fmt.Errorf("%s the table holds %d rows, want %d", when, n, want)
	}
	return nil
}

// publishScenario publishes 20,000 messages, perTx per transaction and per
// Publish call, sequentially on one dedicated connection. Building the
// messages and the per-transaction publisher is part of the timed loop: a
// caller pays for it too.
func publishScenario(perTx int) func(context.Context, *bench, instance) (result, error) {
	return func(ctx context.Context, b *bench, inst instance) (result, error) {
		n := b.count(20_000)
		conn, err := b.conn(ctx)
		if err != nil {
			return result{}, err
		}
		defer conn.Close(context.Background())
		payload := newPayload()

		start := time.Now()
		for sent := 0; sent < n; sent += perTx {
			msgs := newMessages(min(perTx, n-sent), payload)
			t, err := conn.Begin(ctx)
			if err != nil {
				return result{}, err
			}
			if err := inst.publish(ctx, t, msgs); err != nil {
				_ = t.Rollback(context.Background())
				return result{}, fmt.Errorf("publish: %w", err)
			}
			if err := t.Commit(ctx); err != nil {
				return result{}, fmt.Errorf("commit: %w", err)
			}
		}
		elapsed := time.Since(start)

		if err := expectRows(ctx, b, inst, int64(n), "after publishing"); err != nil {
			return result{}, err
		}
		return result{msgsPerS: float64(n) / elapsed.Seconds()}, nil
	}
}

// drainScenario consumes a pre-loaded backlog: 20,000 rows, or
// -backlog-large rows when large. The clock runs from the consumer's start
// until every message was handled AND every ack is written (the row is
// gone), since an ack that is only in memory has not finished the work.
func drainScenario(large bool, maxInFlight int) func(context.Context, *bench, instance) (result, error) {
	return func(ctx context.Context, b *bench, inst instance) (result, error) {
		n := b.count(20_000)
		if large {
			n = b.count(b.opts.backlogLarge)
		}
		if err := inst.loadBacklog(ctx, n, newPayload()); err != nil {
			return result{}, fmt.Errorf("load backlog: %w", err)
		}
		var cpu cpuUse
		elapsed, handled, err := drainLoaded(ctx, b, inst, n, maxInFlight, nil, &cpu)
		if err != nil {
			return result{}, err
		}
		res := result{msgsPerS: float64(n) / elapsed.Seconds(), note: joinNote(inFlightNote(inst, maxInFlight), commitNote(b, inst)),
			serverUs: cpu.perMessage(cpu.server, n), clientUs: cpu.perMessage(cpu.client, n)}
		if extra := handled - int64(n); extra > 0 {
			res.note = joinNote(res.note, fmt.Sprintf("%d redeliveries", extra))
		}
		if large {
			res.note = joinNote(res.note, fmt.Sprintf("backlog %d", n))
		}
		return res, nil
	}
}

// settle makes every drain start from the same state: fresh statistics (the
// planner must see the rows to pick the index scans) and a checkpoint just
// done. The checkpoint means the drain never pays for writing the load's
// dirty pages, and pays the full-page WAL images of every page it touches
// in every run, instead of a timed checkpoint landing in some runs only.
func settle(ctx context.Context, b *bench, inst instance) error {
	if _, err := b.pool.Exec(ctx, `ANALYZE `+inst.table()); err != nil {
		return fmt.Errorf("analyze: %w", err)
	}
	if pi, ok := inst.(*pgoutboxInstance); ok && pi.tables.Arrivals {
		if _, err := b.pool.Exec(ctx, `ANALYZE `+pi.arrivalsTable()); err != nil {
			return fmt.Errorf("analyze: %w", err)
		}
	}
	// CHECKPOINT needs superuser (or pg_checkpoint on 15+); without it the
	// numbers are noisier, not wrong.
	if _, err := b.pool.Exec(ctx, `CHECKPOINT`); err != nil {
		fmt.Fprintf(b.progress, "  (CHECKPOINT skipped: %v)\n", err)
	}
	return nil
}

func joinNote(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "; " + b
}

// awaitDone waits until the handler saw every message and the system wrote
// every ack (closing earlier would cancel acks watermill-sql writes at the
// end of a batch, and leave rows behind for the next run).
func awaitDone(ctx context.Context, handled *countdown, cons consumer, timeout time.Duration, what string) error {
	if err := handled.wait(ctx, timeout, what, cons.failed()); err != nil {
		return withCause(err, cons)
	}
	if err := cons.waitAcked(ctx, timeout); err != nil {
		return withCause(err, cons)
	}
	return nil
}

// closeEmpty closes the consumer and checks that it left no row behind.
func closeEmpty(ctx context.Context, b *bench, inst instance, cons consumer, when string) error {
	if err := cons.close(); err != nil {
		return err
	}
	return expectRows(ctx, b, inst, 0, when)
}

func withCause(err error, cons consumer) error {
	if cause := cons.err(); cause != nil {
		return fmt.Errorf("%w: %w", err, cause)
	}
	return err
}

// latencyScenario measures idle latency: one message every 20 ms, each in
// its own transaction, to a consumer that has nothing else to do. Latency is
// the handler's start minus the moment just before Commit, both on this
// process's clock.
func latencyScenario(maxInFlight int) func(context.Context, *bench, instance) (result, error) {
	return func(ctx context.Context, b *bench, inst instance) (result, error) {
		const interval = 20 * time.Millisecond
		n := b.count(500)
		var (
			mu        sync.Mutex
			committed = make(map[string]time.Time, n)
			latencies = make([]float64, 0, n)
		)
		handled := newCountdown(n)
		cons, err := inst.consumer(ctx, consumeConfig{
			maxInFlight: maxInFlight,
			acks:        n,
			handle: func(uuid string) error {
				now := time.Now()
				mu.Lock()
				defer mu.Unlock()
				t0, ok := committed[uuid]
				if !ok {
					return fmt.Errorf("message %s handled before its commit was recorded", uuid)
				}
				latencies = append(latencies, ms(now.Sub(t0)))
				handled.add(1)
				return nil
			},
		})
		if err != nil {
			return result{}, err
		}
		defer cons.close()
		conn, err := b.conn(ctx)
		if err != nil {
			return result{}, err
		}
		defer conn.Close(context.Background())
		if err := cons.start(ctx); err != nil {
			return result{}, err
		}
		// Let the consumer reach its idle state (LISTEN set up, first empty
		// claim done): this scenario is about waking an idle consumer.
		if !sleepCtx(ctx, time.Second) {
			return result{}, ctx.Err()
		}

		payload := newPayload()
		begin := time.Now()
		for i := range n {
			// Paced against the start, so a slow publish does not push every
			// later message back.
			if !sleepCtx(ctx, time.Until(begin.Add(time.Duration(i)*interval))) {
				return result{}, ctx.Err()
			}
			msgs := newMessages(1, payload)
			t, err := conn.Begin(ctx)
			if err != nil {
				return result{}, err
			}
			if err := inst.publish(ctx, t, msgs); err != nil {
				_ = t.Rollback(context.Background())
				return result{}, fmt.Errorf("publish: %w", err)
			}
			mu.Lock()
			committed[msgs[0].UUID] = time.Now()
			mu.Unlock()
			if err := t.Commit(ctx); err != nil {
				return result{}, fmt.Errorf("commit: %w", err)
			}
		}
		if err := awaitDone(ctx, handled, cons, 30*time.Second, "messages handled"); err != nil {
			return result{}, err
		}
		if err := closeEmpty(ctx, b, inst, cons, "after the run"); err != nil {
			return result{}, err
		}
		mu.Lock()
		defer mu.Unlock()
		return result{
			p50ms: percentile(latencies, 0.50),
			p99ms: percentile(latencies, 0.99),
			note:  inFlightNote(inst, maxInFlight),
		}, nil
	}
}

// timersScenario (pgoutbox only) publishes 200 messages due at random
// points in the next 3 s to a subscriber that would poll only every 10 s,
// and measures how late each fired on the database clock: claim time
// (leased_until - Lease; for a held claim, which leaves no lease, the time
// the handler reads the row, later than the claim) minus available_at. A
// negative value means a timer fired early, which is a bug, so the run
// fails.
func timersScenario(ctx context.Context, b *bench, inst instance) (result, error) {
	const (
		span  = 3 * time.Second
		calls = 4 // "a few Publish calls"
	)
	n := b.count(200)
	var (
		mu       sync.Mutex
		lateness []float64
		early    []string
	)
	handled := newCountdown(n)
	cons, err := inst.consumer(ctx, consumeConfig{
		maxInFlight: timersMaxInFlight,
		acks:        n,
		timers:      true,
		handle: func(uuid string) error {
			var lateMs float64
			// Read before the ack: the row (and its lease) is gone after it.
			err := b.pool.QueryRow(ctx, `
				SELECT 1000 * extract(epoch FROM coalesce(leased_until - $2 * interval '1 microsecond', clock_timestamp()) - available_at)
				  FROM `+inst.table()+` WHERE uuid = $1`, uuid, timersLease.Microseconds()).Scan(&lateMs)
			if err != nil {
				return fmt.Errorf("read lateness of %s: %w", uuid, err)
			}
			mu.Lock()
			lateness = append(lateness, lateMs)
			if lateMs < 0 {
				early = append(early, fmt.Sprintf("%s %.3f ms early", uuid, -lateMs))
			}
			mu.Unlock()
			handled.add(1)
			return nil
		},
	})
	if err != nil {
		return result{}, err
	}
	defer cons.close()
	if err := cons.start(ctx); err != nil {
		return result{}, err
	}
	// The subscriber must be idle, asleep in its 10 s poll, when the timers
	// arrive: only the publish's wake-up and the timer planning can make
	// them fire on time.
	if !sleepCtx(ctx, time.Second) {
		return result{}, ctx.Err()
	}

	msgs := newMessages(n, newPayload())
	for _, m := range msgs {
		pgoutbox.DeliverAfter(m, time.Duration(rand.Int64N(int64(span))))
	}
	per := (n + calls - 1) / calls
	for i := 0; i < n; i += per {
		t, err := b.pool.Begin(ctx)
		if err != nil {
			return result{}, err
		}
		if err := inst.publish(ctx, t, msgs[i:min(i+per, n)]); err != nil {
			_ = t.Rollback(context.Background())
			return result{}, fmt.Errorf("publish: %w", err)
		}
		if err := t.Commit(ctx); err != nil {
			return result{}, err
		}
	}
	if err := awaitDone(ctx, handled, cons, span+30*time.Second, "timers fired"); err != nil {
		return result{}, err
	}
	if err := closeEmpty(ctx, b, inst, cons, "after the timers fired"); err != nil {
		return result{}, err
	}
	mu.Lock()
	defer mu.Unlock()
	if len(early) > 0 {
		return result{}, fmt.Errorf("%d of %d timers fired EARLY: %s", len(early), n, strings.Join(early[:min(5, len(early))], ", "))
	}
	return result{
		p50ms: percentile(lateness, 0.50),
		p99ms: percentile(lateness, 0.99),
		note:  fmt.Sprintf("lateness on the DB clock, %d timers in %s, poll 10s, MaxInFlight %d", n, span, timersMaxInFlight),
	}, nil
}

// sleepCtx sleeps d (nothing if d <= 0); false means ctx ended.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// concurrentPublishScenario publishes 20,000 messages, one per transaction,
// from publishers goroutines at once, each on its own connection: the
// path of request handlers that each write a domain change and its event.
// Commits are what it measures (a transaction that NOTIFYs serializes
// them).
func concurrentPublishScenario(publishers int) func(context.Context, *bench, instance) (result, error) {
	return func(ctx context.Context, b *bench, inst instance) (result, error) {
		n := b.count(20_000)
		conns := make([]*pgx.Conn, publishers)
		for i := range conns {
			c, err := b.conn(ctx)
			if err != nil {
				return result{}, err
			}
			defer c.Close(context.Background())
			conns[i] = c
		}
		payload := newPayload()
		errs := make(chan error, publishers)
		start := time.Now()
		for i, conn := range conns {
			share := n / publishers
			if i < n%publishers {
				share++
			}
			go func() {
				for range share {
					t, err := conn.Begin(ctx)
					if err != nil {
						errs <- err
						return
					}
					if err := inst.publish(ctx, t, newMessages(1, payload)); err != nil {
						_ = t.Rollback(context.Background())
						errs <- fmt.Errorf("publish: %w", err)
						return
					}
					if err := t.Commit(ctx); err != nil {
						errs <- fmt.Errorf("commit: %w", err)
						return
					}
				}
				errs <- nil
			}()
		}
		for range publishers {
			if err := <-errs; err != nil {
				return result{}, err
			}
		}
		elapsed := time.Since(start)
		if err := expectRows(ctx, b, inst, int64(n), "after publishing"); err != nil {
			return result{}, err
		}
		return result{msgsPerS: float64(n) / elapsed.Seconds()}, nil
	}
}

// busyLatencyScenario measures commit-to-handler latency while 16
// publishers each write one message per transaction every 5ms (3,200
// messages/s in all, below what every system sustains, so the figure is
// about wake-ups, not saturation), to a subscriber (MaxInFlight 16) that
// keeps up: the wake-ups publishers skip must not make messages wait.
func busyLatencyScenario(ctx context.Context, b *bench, inst instance) (result, error) {
	const (
		publishers = 16
		every      = 5 * time.Millisecond
	)
	n := b.count(16_000)
	var (
		mu        sync.Mutex
		committed = make(map[string]time.Time, n)
		latencies = make([]float64, 0, n)
	)
	handled := newCountdown(n)
	cons, err := inst.consumer(ctx, consumeConfig{
		maxInFlight: 16,
		acks:        n,
		handle: func(uuid string) error {
			now := time.Now()
			mu.Lock()
			defer mu.Unlock()
			if t0, ok := committed[uuid]; ok {
				latencies = append(latencies, ms(now.Sub(t0)))
			} else {
				committed[uuid] = time.Time{} // handled before its commit was recorded: latency ~0
				latencies = append(latencies, 0)
			}
			handled.add(1)
			return nil
		},
	})
	if err != nil {
		return result{}, err
	}
	defer cons.close()
	if err := cons.start(ctx); err != nil {
		return result{}, err
	}
	if !sleepCtx(ctx, time.Second) { // idle, LISTEN set up
		return result{}, ctx.Err()
	}
	payload := newPayload()
	errs := make(chan error, publishers)
	for i := range publishers {
		conn, err := b.conn(ctx)
		if err != nil {
			return result{}, err
		}
		defer conn.Close(context.Background())
		share := n / publishers
		if i < n%publishers {
			share++
		}
		go func() {
			begin := time.Now()
			for k := range share {
				// Paced against the start, so a slow commit does not push
				// every later message back.
				if !sleepCtx(ctx, time.Until(begin.Add(time.Duration(k)*every))) {
					errs <- ctx.Err()
					return
				}
				msgs := newMessages(1, payload)
				t, err := conn.Begin(ctx)
				if err == nil {
					err = inst.publish(ctx, t, msgs)
				}
				if err != nil {
					_ = t.Rollback(context.Background())
					errs <- err
					return
				}
				mu.Lock()
				if _, seen := committed[msgs[0].UUID]; !seen {
					committed[msgs[0].UUID] = time.Now()
				}
				mu.Unlock()
				if err := t.Commit(ctx); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range publishers {
		if err := <-errs; err != nil {
			return result{}, err
		}
	}
	if err := awaitDone(ctx, handled, cons, 60*time.Second, "messages handled"); err != nil {
		return result{}, err
	}
	if err := closeEmpty(ctx, b, inst, cons, "after the run"); err != nil {
		return result{}, err
	}
	mu.Lock()
	defer mu.Unlock()
	return result{p50ms: percentile(latencies, 0.50), p99ms: percentile(latencies, 0.99)}, nil
}

// groupPublishScenario (pgoutbox only) is publish-100 with groups consumer
// groups bound to the topic: every message becomes one row per group, in
// the same one statement per Publish. It reports messages per second.
func groupPublishScenario(groups int) func(context.Context, *bench, instance) (result, error) {
	return func(ctx context.Context, b *bench, inst instance) (result, error) {
		pi := inst.(*pgoutboxInstance)
		for g := range groups {
			if err := pgoutbox.Bind(ctx, tx.FromPgxPool(b.pool), pi.tables, topic, fmt.Sprintf("g%d", g)); err != nil {
				return result{}, err
			}
		}
		const perTx = 100
		n := b.count(20_000)
		conn, err := b.conn(ctx)
		if err != nil {
			return result{}, err
		}
		defer conn.Close(context.Background())
		payload := newPayload()
		start := time.Now()
		for sent := 0; sent < n; sent += perTx {
			t, err := conn.Begin(ctx)
			if err != nil {
				return result{}, err
			}
			if err := inst.publish(ctx, t, newMessages(min(perTx, n-sent), payload)); err != nil {
				_ = t.Rollback(context.Background())
				return result{}, fmt.Errorf("publish: %w", err)
			}
			if err := t.Commit(ctx); err != nil {
				return result{}, fmt.Errorf("commit: %w", err)
			}
		}
		elapsed := time.Since(start)
		rows := groups
		if pi.tables.Arrivals {
			rows = 1 // the subscribers fan arrivals out
		}
		if err := expectRows(ctx, b, inst, int64(n*rows), "after publishing"); err != nil {
			return result{}, err
		}
		return result{msgsPerS: float64(n) / elapsed.Seconds(), note: fmt.Sprintf("%d rows per message", rows)}, nil
	}
}

// groupDrainScenario (pgoutbox only) drains a 20,000-message backlog that
// groups consumer groups each have a copy of, with one subscriber per
// group (MaxInFlight 16) running at once. It reports rows per second in
// all. With arrivals, the backlog is arrivals of the groups bound first,
// which the subscribers fan out as they go.
func groupDrainScenario(groups int) func(context.Context, *bench, instance) (result, error) {
	return func(ctx context.Context, b *bench, inst instance) (result, error) {
		n := b.count(20_000)
		load := `
			INSERT INTO ` + inst.table() + ` (topic, consumer_group, uuid, payload)
			SELECT $1, 'g' || grp, gen_random_uuid()::text, $2::bytea
			  FROM generate_series(1, $3), generate_series(0, $4 - 1) AS grp`
		if pi := inst.(*pgoutboxInstance); pi.tables.Arrivals {
			var names []string
			for g := range groups {
				names = append(names, fmt.Sprintf("g%d", g))
			}
			if _, err := pgoutbox.BindGroups(ctx, tx.FromPgxPool(b.pool), pi.tables, topic, names); err != nil {
				return result{}, err
			}
			load = `
			INSERT INTO ` + pi.arrivalsTable() + ` (topic, uuid, payload)
			SELECT $1, gen_random_uuid()::text, $2::bytea FROM generate_series(1, $3) WHERE $4::int > 0`
		}
		if _, err := b.pool.Exec(ctx, load, topic, newPayload(), n, groups); err != nil {
			return result{}, fmt.Errorf("load backlog: %w", err)
		}
		if err := settle(ctx, b, inst); err != nil {
			return result{}, err
		}
		handled := newCountdown(n * groups)
		var cons []consumer
		for g := range groups {
			c, err := inst.consumer(ctx, consumeConfig{
				maxInFlight: 16,
				acks:        n,
				group:       fmt.Sprintf("g%d", g),
				handle: func(string) error {
					handled.add(1)
					return nil
				},
			})
			if err != nil {
				return result{}, err
			}
			defer c.close()
			cons = append(cons, c)
		}
		start := time.Now()
		for _, c := range cons {
			if err := c.start(ctx); err != nil {
				return result{}, err
			}
		}
		for _, c := range cons {
			if err := awaitDone(ctx, handled, c, time.Minute+time.Duration(n*groups)*5*time.Millisecond, "messages handled"); err != nil {
				return result{}, err
			}
		}
		elapsed := time.Since(start)
		for _, c := range cons {
			if err := c.close(); err != nil {
				return result{}, err
			}
		}
		if err := expectRows(ctx, b, inst, 0, "after the drain"); err != nil {
			return result{}, err
		}
		return result{msgsPerS: float64(n*groups) / elapsed.Seconds(), note: fmt.Sprintf("%d groups, rows/s in all", groups)}, nil
	}
}

// keyedDrainScenario drains a backlog spread over keys ordering keys (0:
// none) with handlers that work 1 ms each: per-key order with 16 in
// flight, against the same work unkeyed, and against MaxInFlight 1, the
// way to keep order without keys.
func keyedDrainScenario(keys, maxInFlight int) func(context.Context, *bench, instance) (result, error) {
	return keyedDrain(keys, maxInFlight, false)
}

// keyedDrain is keyedDrainScenario; blocked holds a snapshot on another
// connection from the load to the drain's end (as soak-blocked does), so
// nothing the drain deletes can be removed, nor its index entries skipped.
func keyedDrain(keys, maxInFlight int, blocked bool) func(context.Context, *bench, instance) (result, error) {
	return func(ctx context.Context, b *bench, inst instance) (result, error) {
		n := b.count(4_000)
		key := "NULL"
		if keys > 0 {
			key = fmt.Sprintf("'k' || (g %% %d)", keys)
		}
		if _, err := b.pool.Exec(ctx, `
			INSERT INTO `+inst.table()+` (topic, uuid, payload, ordering_key)
			SELECT $1, gen_random_uuid()::text, $2::bytea, `+key+` FROM generate_series(1, $3) g`,
			topic, newPayload(), n); err != nil {
			return result{}, fmt.Errorf("load backlog: %w", err)
		}
		if blocked {
			release, err := b.holdSnapshot(ctx)
			if err != nil {
				return result{}, err
			}
			defer release()
		}
		elapsed, _, err := drainLoaded(ctx, b, inst, n, maxInFlight, func() { time.Sleep(time.Millisecond) }, nil)
		if err != nil {
			return result{}, err
		}
		note := fmt.Sprintf("1 ms handlers, %d in flight", maxInFlight)
		if keys > 0 {
			note += fmt.Sprintf(", %d keys", keys)
		}
		if blocked {
			note += ", a snapshot held"
		}
		return result{msgsPerS: float64(n) / elapsed.Seconds(), note: note}, nil
	}
}

// drainLoaded consumes the n rows loaded into inst with maxInFlight
// handlers that run work (if any) per message, and returns how long from
// the consumer's start until all were handled, and how many handlings
// there were (redeliveries included). The table must be empty after.
//
// With cpu, it also measures the CPU time the server (when it runs on this
// machine: the machine's less this process's, so nothing else may run
// meanwhile) and this process spent from the consumer's start to the end
// of the drain.
func drainLoaded(ctx context.Context, b *bench, inst instance, n, maxInFlight int, work func(), cpu *cpuUse) (time.Duration, int64, error) {
	if err := settle(ctx, b, inst); err != nil {
		return 0, 0, err
	}
	handled := newCountdown(n)
	cons, err := inst.consumer(ctx, consumeConfig{
		maxInFlight: maxInFlight,
		acks:        n,
		handle: func(string) error {
			if work != nil {
				work()
			}
			handled.add(1)
			return nil
		},
	})
	if err != nil {
		return 0, 0, err
	}
	defer cons.close()
	// Generous: fail only below 200 msg/s, far under any system here.
	timeout := time.Minute + time.Duration(n)*5*time.Millisecond
	start := time.Now()
	all0, cli0 := machineCPU(b.postmaster), processCPU()
	if err := cons.start(ctx); err != nil {
		return 0, 0, err
	}
	if err := awaitDone(ctx, handled, cons, timeout, "messages handled"); err != nil {
		return 0, 0, err
	}
	elapsed := time.Since(start)
	if err := closeEmpty(ctx, b, inst, cons, "after the drain"); err != nil {
		return 0, 0, err
	}
	if cpu != nil {
		all1, cli1 := machineCPU(b.postmaster), processCPU()
		cpu.server, cpu.client = -1, cli1-cli0
		if all0 >= 0 && all1 >= 0 {
			cpu.server = max(all1-all0-cpu.client, 0)
		}
	}
	return elapsed, handled.count(), nil
}

// slowOneInThousandScenario drains a 20,000-row backlog with 16 in flight
// where every 1000th message's handler sleeps 2 s, the rest return at
// once. It reports the rate of the others (until the last of them was
// handled) and, in the note, the oldest transaction pg_stat_activity
// showed in this database meanwhile (sampled every 10 ms): on the held
// path a slow handler must neither hold its batch's transaction open past
// the bound nor hold back the other rows.
func slowOneInThousandScenario(ctx context.Context, b *bench, inst instance) (result, error) {
	const every, sleep, inFlight = 1000, 2 * time.Second, 16
	n := b.count(20_000)
	if err := inst.loadBacklog(ctx, n, newPayload()); err != nil {
		return result{}, fmt.Errorf("load backlog: %w", err)
	}
	fast := int64(n - n/every)
	var seen, fastDone atomic.Int64
	var firstAt, fastAt atomic.Int64 // unix nanos: the first message handled, the last fast one
	sampleCtx, stopSampling := context.WithCancel(ctx)
	oldest := make(chan time.Duration, 1)
	go func() {
		var worst time.Duration
		defer func() { oldest <- worst }()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-sampleCtx.Done():
				return
			case <-tick.C:
			}
			var us int64
			if err := b.pool.QueryRow(sampleCtx, `
				SELECT coalesce(max((extract(epoch FROM clock_timestamp() - xact_start) * 1000000)::bigint), 0)
				  FROM pg_stat_activity
				 WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL`).Scan(&us); err == nil {
				worst = max(worst, time.Duration(us)*time.Microsecond)
			}
		}
	}()
	_, _, err := drainLoaded(ctx, b, inst, n, inFlight, func() {
		firstAt.CompareAndSwap(0, time.Now().UnixNano())
		if seen.Add(1)%every == 0 {
			time.Sleep(sleep)
			return
		}
		if fastDone.Add(1) == fast {
			fastAt.Store(time.Now().UnixNano())
		}
	}, nil)
	stopSampling()
	worst := <-oldest
	if err != nil {
		return result{}, err
	}
	elapsed := time.Duration(fastAt.Load() - firstAt.Load())
	return result{msgsPerS: float64(fast) / elapsed.Seconds(),
		note: fmt.Sprintf("rate of the fast ones; oldest transaction seen %s", worst.Round(time.Millisecond))}, nil
}
