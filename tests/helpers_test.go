package tests

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// bundle is one test's outbox: the tables in a schema of the test's own
// (pgoutboxtest reuses it, emptied, for a later test).
type bundle struct {
	*pgoutboxtest.Env
	tables schema.Config
	logger watermill.LoggerAdapter
}

func setup(t testing.TB, opts ...pgoutboxtest.Options) *bundle {
	t.Helper()
	var o pgoutboxtest.Options
	if len(opts) > 0 {
		o = opts[0]
	}
	env := pgoutboxtest.PubSubWithOptions(t, o)
	require.Equal(t, schema.Config{Schema: env.Schema, Table: "outbox", DeadLetterTable: "outbox_dlq"}, env.Tables)
	return &bundle{Env: env, tables: env.Tables, logger: watermill.NewStdLogger(false, false)}
}

// subscriber builds a Subscriber closed at the end of the test; fast
// defaults for tests, overridable through mod.
func (b *bundle) subscriber(t *testing.T, mod func(*pgoutbox.SubscriberConfig)) *pgoutbox.Subscriber {
	t.Helper()
	return b.subscriberOn(t, b.Pool, mod)
}

// subscriberOn is subscriber on a pool of the test's own.
func (b *bundle) subscriberOn(t *testing.T, pool *pgxpool.Pool, mod func(*pgoutbox.SubscriberConfig)) *pgoutbox.Subscriber {
	t.Helper()
	cfg := pgoutbox.SubscriberConfig{
		Tables:          b.tables,
		Lease:           5 * time.Second,
		MinPollInterval: 20 * time.Millisecond,
		MaxPollInterval: time.Second,
		DrainTimeout:    2 * time.Second,
		RetryPolicy:     pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: -1},
	}
	if mod != nil {
		mod(&cfg)
	}
	sub, err := pgoutbox.NewSubscriber(pool, cfg, b.logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// namedPool is a pool of the test's own whose connections carry
// application_name app, so that they can be found in pg_stat_activity
// (the notifier opens its LISTEN connection with the pool's ConnConfig, so
// it carries the name too). It is closed at the end of the test.
func (b *bundle) namedPool(t *testing.T, app string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(b.DSN)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

func (b *bundle) poolPublisher(t testing.TB) *pgoutbox.Publisher {
	t.Helper()
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
	require.NoError(t, err)
	return pub
}

func (b *bundle) count(t testing.TB, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.Pool.QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

func (b *bundle) outboxRows(t testing.TB, topic string) int {
	return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = $1`, topic)
}

func newMsg(payload string) *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(payload))
}

// newMsgs returns n messages whose payloads are "0", "1", ...
func newMsgs(n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = newMsg(fmt.Sprint(i))
	}
	return msgs
}

// receive waits for one message or fails the test.
func receive(t *testing.T, ch <-chan *message.Message, within time.Duration) *message.Message {
	t.Helper()
	select {
	case m, ok := <-ch:
		require.True(t, ok, "channel closed while waiting for a message")
		return m
	case <-time.After(within):
		t.Fatalf("no message within %s", within)
		return nil
	}
}

// requireNothing asserts that no message arrives within d.
func requireNothing(t *testing.T, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case m, ok := <-ch:
		if ok {
			t.Fatalf("unexpected message %s (%s)", m.UUID, m.Payload)
		}
	case <-time.After(d):
	}
}

// events records observer events and lets a test wait for one.
type events struct {
	mu   sync.Mutex
	list []pgoutbox.Event
	ch   chan pgoutbox.Event
}

func newEvents() *events { return &events{ch: make(chan pgoutbox.Event, 10000)} }

func (e *events) Observe(ev pgoutbox.Event) {
	e.mu.Lock()
	e.list = append(e.list, ev)
	e.mu.Unlock()
	select {
	case e.ch <- ev:
	default:
	}
}

func (e *events) wait(t *testing.T, kind pgoutbox.EventKind, within time.Duration) pgoutbox.Event {
	t.Helper()
	deadline := time.After(within)
	for {
		select {
		case ev := <-e.ch:
			if ev.Kind == kind {
				return ev
			}
		case <-deadline:
			t.Fatalf("no %s event within %s", kind, within)
		}
	}
}

func (e *events) countKind(kind pgoutbox.EventKind) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, ev := range e.list {
		if ev.Kind == kind {
			n++
		}
	}
	return n
}

// logCapture is a LoggerAdapter that records entries; safe for concurrent
// use (watermill's CaptureLoggerAdapter hands out its live map).
type logCapture struct {
	mu      sync.Mutex
	entries []logEntry
	fields  watermill.LogFields
	parent  *logCapture
}

type logEntry struct {
	level  string
	msg    string
	err    error
	fields watermill.LogFields
}

func (l *logCapture) root() *logCapture {
	if l.parent != nil {
		return l.parent
	}
	return l
}

func (l *logCapture) add(level, msg string, err error, fields watermill.LogFields) {
	r := l.root()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.entries = append(r.entries, logEntry{level, msg, err, l.fields.Add(fields)})
}

func (l *logCapture) Error(msg string, err error, fields watermill.LogFields) {
	l.add("error", msg, err, fields)
}
func (l *logCapture) Info(msg string, fields watermill.LogFields)  { l.add("info", msg, nil, fields) }
func (l *logCapture) Debug(msg string, fields watermill.LogFields) { l.add("debug", msg, nil, fields) }
func (l *logCapture) Trace(msg string, fields watermill.LogFields) { l.add("trace", msg, nil, fields) }
func (l *logCapture) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &logCapture{fields: l.fields.Add(fields), parent: l.root()}
}

// find returns the entries of a level that match.
func (l *logCapture) find(level string, match func(logEntry) bool) []logEntry {
	r := l.root()
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []logEntry
	for _, e := range r.entries {
		if e.level == level && match(e) {
			out = append(out, e)
		}
	}
	return out
}

// claimPaths are the claim paths every guarantee is tested on: the default
// (ClaimAuto, which picks per claim), and each path forced for every claim.
var claimPaths = []string{"auto", testhook.PathHeld, testhook.PathLease}

// onEachClaimPath runs f as a parallel subtest per claim path.
func onEachClaimPath(t *testing.T, f func(t *testing.T, path string)) {
	t.Helper()
	for _, p := range claimPaths {
		t.Run("path="+p, func(t *testing.T) {
			t.Parallel()
			f(t, p)
		})
	}
}

// onPath makes a subscriber configured by c take path on every claim (a
// worker id of its own carries the hook); "auto" leaves c as it is.
func onPath(t *testing.T, path string, c *pgoutbox.SubscriberConfig) {
	t.Helper()
	if path == "auto" {
		return
	}
	if c.WorkerID == "" {
		c.WorkerID = "test-" + path + "-" + watermill.NewShortUUID()
	}
	id := c.WorkerID
	testhook.ForceClaimPath(id, path)
	t.Cleanup(func() { testhook.ForceClaimPath(id, "") })
}

// onEachClaimMode runs run as a parallel subtest per claim mode: the
// default (ClaimAuto), leases only and the held path.
func onEachClaimMode(t *testing.T, run func(t *testing.T, mode pgoutbox.ClaimMode)) {
	t.Helper()
	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimAuto, pgoutbox.ClaimLease, pgoutbox.ClaimHeld} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			run(t, mode)
		})
	}
}

// column returns the first column of every row of q, as T.
func column[T any](t *testing.T, b *bundle, q string, args ...any) []T {
	t.Helper()
	rows, err := b.Pool.Query(context.Background(), q, args...)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[T])
	require.NoError(t, err)
	return out
}

// requireClosed runs closeFn (a Subscriber's Close, say) and fails the
// test if it returns an error, or does not return within 15 s; what names
// it in the failure.
func requireClosed(t *testing.T, what string, closeFn func() error) {
	t.Helper()
	closed := make(chan error, 1)
	go func() { closed <- closeFn() }()
	select {
	case err := <-closed:
		require.NoError(t, err, what)
	case <-time.After(15 * time.Second):
		t.Fatalf("%s did not return", what)
	}
}

// takeUUIDs receives n messages from ch, acks them, checks that nothing
// more comes, and returns their UUIDs, sorted.
func takeUUIDs(t *testing.T, ch <-chan *message.Message, n int) []string {
	t.Helper()
	var got []string
	for range n {
		m := receive(t, ch, 10*time.Second)
		got = append(got, m.UUID)
		m.Ack()
	}
	requireNothing(t, ch, 200*time.Millisecond)
	slices.Sort(got)
	return got
}
