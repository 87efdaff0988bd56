package pgoutboxtest_test

import (
	"context"
	"database/sql"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// fakeTB records what a helper reports instead of failing the real test.
// Fatalf ends the calling goroutine like testing.T's does, so run the
// helper through capture.
type fakeTB struct {
	testing.TB // nil: any method not overridden panics, so the test sees it
	mu         sync.Mutex
	failed     bool
	logs       []string
	cleanups   []func()
}

func (f *fakeTB) Helper() {}
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.failed = true
	f.logs = append(f.logs, fmt.Sprintf(format, args...))
	f.mu.Unlock()
	runtime.Goexit()
}
func (f *fakeTB) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failed = true
	f.logs = append(f.logs, fmt.Sprintf(format, args...))
}
func (f *fakeTB) Logf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.logs = append(f.logs, fmt.Sprintf(format, args...))
}
func (f *fakeTB) Cleanup(fn func()) { f.cleanups = append(f.cleanups, fn) }

// cleanup runs the registered cleanups, last first, as testing does.
func (f *fakeTB) cleanup() {
	for i := len(f.cleanups) - 1; i >= 0; i-- {
		f.cleanups[i]()
	}
	f.cleanups = nil
}

// capture runs fn with a fake TB in a goroutine of its own (Fatalf ends
// it) and returns whether it failed and what it reported.
func capture(fn func(tb testing.TB)) (failed bool, output string) {
	f := &fakeTB{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failed, strings.Join(f.logs, "\n")
}

func msg(payload string) *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(payload))
}

func TestPubSubPublishAndDrain(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	require.NoError(t, env.Publisher.Publish("orders", msg("1"), msg("2"), msg("3")))
	got := env.Drain(t, "orders", 3, 30*time.Second)
	require.Equal(t, []string{"1", "2", "3"}, []string{string(got[0].Payload), string(got[1].Payload), string(got[2].Payload)})
	env.RequireNotPublished(t, env.Exec(), "orders") // acked: gone from the outbox
}

func TestRequirePublishedInTransaction(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	ctx := context.Background()
	pgxTx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = pgxTx.Rollback(ctx) }()
	exec := tx.FromPgxTx(pgxTx)

	m := msg(`{"order": 42, "item": "book"}`)
	m.Metadata.Set("tenant", "acme")
	require.NoError(t, env.TxPublisher(t, exec).Publish("orders.placed", m, msg("other")))

	got := env.RequirePublished(t, exec, "orders.placed",
		pgoutboxtest.WithJSONPayload(map[string]any{"item": "book", "order": 42}),
		pgoutboxtest.WithMetadata("tenant", "acme"))
	require.Len(t, got, 1)
	require.Equal(t, m.UUID, got[0].UUID)
	env.RequirePublished(t, exec, "orders.placed", pgoutboxtest.Count(2))
	env.RequirePublished(t, exec, "orders.placed", pgoutboxtest.Where("payload starts with {", func(m *message.Message) bool {
		return strings.HasPrefix(string(m.Payload), "{")
	}), pgoutboxtest.Count(1))
	// Not committed: the pool does not see it.
	env.RequireNotPublished(t, env.Exec(), "orders.placed")
	require.NoError(t, pgxTx.Rollback(ctx))
	env.RequireNotPublished(t, env.Exec(), "orders.placed")
}

// The package's assertions given env.Exec() read the Env's outbox, not
// public.outbox, which a test database may have (one holding nothing of
// the test's, where RequireNotPublished passed).
func TestPackageAssertionsOnAnEnvsExecutorReadItsOutbox(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	m := msg("x")
	require.NoError(t, env.Publisher.Publish("orders", m))
	got := pgoutboxtest.RequirePublished(t, env.Exec(), "orders", pgoutboxtest.Count(1))
	require.Equal(t, m.UUID, got[0].UUID)
	failed, out := capture(func(tb testing.TB) { pgoutboxtest.RequireNotPublished(tb, env.Exec(), "orders") })
	require.True(t, failed, "the message is in the Env's outbox")
	require.Contains(t, out, "want no message on topic \"orders\", found 1")

}

// labelledTx is a database/sql handle wrapper of the kind FromSQLQueryer
// takes (sqlx, bun, an application's own), whose value cannot be hashed.
type labelledTx struct {
	*sql.Tx
	labels []string
}

// An assertion given such an executor reads the outbox InTables names, or
// the default one: finding out whether it is an Env's must not panic.
func TestAssertionsTakeExecutorsThatCannotBeHashed(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	db := stdlib.OpenDBFromPool(env.Pool)
	t.Cleanup(func() { _ = db.Close() })
	sqlTx, err := db.Begin()
	require.NoError(t, err)
	defer sqlTx.Rollback() //nolint:errcheck // read only
	exec := tx.FromSQLQueryer(labelledTx{sqlTx, []string{"a"}})
	require.NoError(t, env.Publisher.Publish("orders", msg("x")))
	pgoutboxtest.RequirePublished(t, exec, "orders", pgoutboxtest.InTables(env.Tables), pgoutboxtest.Count(1))
	failed, out := capture(func(tb testing.TB) { pgoutboxtest.RequireNotPublished(tb, exec, "orders") })
	if failed { // no public.outbox in this database: it says how to name the Env's
		require.Contains(t, out, "InTables(env.Tables)", out)
	}
}

func TestRequirePublishedCountsMessagesNotGroupCopies(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	ctx := context.Background()
	for _, g := range []string{"billing", "shipping"} {
		require.NoError(t, pgoutbox.Bind(ctx, env.Exec(), env.Tables, "orders", g))
	}
	m := msg("x")
	require.NoError(t, env.Publisher.Publish("orders", m))
	env.RequirePublished(t, env.Exec(), "orders", pgoutboxtest.Count(1))
	// The same UUID published again is a second message.
	require.NoError(t, env.Publisher.Publish("orders", message.NewMessage(m.UUID, []byte("y"))))
	env.RequirePublished(t, env.Exec(), "orders", pgoutboxtest.Count(2), pgoutboxtest.WithUUID(m.UUID))
}

// The ordering key is stored in a column, not in the metadata; the
// messages RequirePublished returns carry it as a delivered message does.
func TestRequirePublishedSeesOrderingKeys(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	a1, a2, b1, plain := msg("a1"), msg("a2"), msg("b1"), msg("plain")
	pgoutbox.WithOrderingKey(a1, "account-a")
	pgoutbox.WithOrderingKey(a2, "account-a")
	pgoutbox.WithOrderingKey(b1, "account-b")
	require.NoError(t, env.Publisher.Publish("payments", a1, plain, b1, a2))

	got := env.RequirePublished(t, env.Exec(), "payments", pgoutboxtest.WithOrderingKey("account-a"), pgoutboxtest.Count(2))
	require.Equal(t, []string{"a1", "a2"}, []string{string(got[0].Payload), string(got[1].Payload)})
	require.Equal(t, "account-a", got[0].Metadata.Get(pgoutbox.OrderingKeyMetadataKey))
	env.RequireNotPublished(t, env.Exec(), "payments", pgoutboxtest.WithOrderingKey("account-c"))
	all := env.RequirePublished(t, env.Exec(), "payments", pgoutboxtest.Count(4))
	require.Empty(t, all[1].Metadata.Get(pgoutbox.OrderingKeyMetadataKey), "an unkeyed message has no key")

	keys := map[string]string{}
	for _, m := range all {
		keys[m.UUID] = m.Metadata.Get(pgoutbox.OrderingKeyMetadataKey)
	}
	for _, m := range env.Drain(t, "payments", 4, 30*time.Second) {
		require.Equal(t, keys[m.UUID], m.Metadata.Get(pgoutbox.OrderingKeyMetadataKey), "RequirePublished shows the key a delivery carries")
	}
}

func TestRequirePublishedFailureShowsWhatWasThere(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	m := msg(`{"order":1}`)
	m.Metadata.Set("tenant", "acme")
	require.NoError(t, env.Publisher.Publish("orders.placed", m))

	failed, out := capture(func(tb testing.TB) {
		env.RequirePublished(tb, env.Exec(), "orders.placed", pgoutboxtest.WithPayload([]byte(`{"order":2}`)))
	})
	require.True(t, failed)
	require.Contains(t, out, `want at least 1 message on topic "orders.placed" with payload "{\"order\":2}", found 0.`)
	require.Contains(t, out, "The topic holds 1 message(s):")
	require.Contains(t, out, "uuid="+m.UUID+` payload="{\"order\":1}" metadata{tenant="acme"}`)

	failed, out = capture(func(tb testing.TB) {
		env.RequirePublished(tb, env.Exec(), "order.placed") // misspelt
	})
	require.True(t, failed)
	require.Contains(t, out, `want at least 1 message on topic "order.placed", found 0.`)
	require.Contains(t, out, `The topic holds no message in `+env.Schema+`.outbox. Other topics: "orders.placed" (1).`)

	failed, out = capture(func(tb testing.TB) {
		env.RequirePublished(tb, env.Exec(), "orders.placed", pgoutboxtest.Count(2))
	})
	require.True(t, failed)
	require.Contains(t, out, `want 2 message(s) on topic "orders.placed", found 1.`)

	failed, out = capture(func(tb testing.TB) {
		env.RequireNotPublished(tb, env.Exec(), "orders.placed", pgoutboxtest.WithMetadata("tenant", "acme"))
	})
	require.True(t, failed)
	require.Contains(t, out, `want no message on topic "orders.placed" with metadata tenant="acme", found 1.`)

	failed, _ = capture(func(tb testing.TB) {
		env.RequirePublished(tb, env.Exec(), "orders.placed", pgoutboxtest.WithMetadata("tenant", "acme"))
	})
	require.False(t, failed)
}

func TestRequireScheduled(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	var before time.Time
	require.NoError(t, env.Pool.QueryRow(context.Background(), `SELECT now()`).Scan(&before))

	m := msg("remind")
	pgoutbox.DeliverAfter(m, time.Hour)
	pgoutbox.WithDedupKey(m, "remind-order-42")
	require.NoError(t, env.Publisher.Publish("reminders", m))
	at := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	m2 := msg("later")
	pgoutbox.DeliverAt(m2, at)
	pgoutbox.WithDedupKey(m2, "remind-order-43")
	require.NoError(t, env.Publisher.Publish("reminders", m2))

	due := env.RequireScheduled(t, env.Exec(), "reminders", "remind-order-42")
	require.WithinDuration(t, before.Add(time.Hour), due, time.Minute)
	require.True(t, at.Equal(env.RequireScheduled(t, env.Exec(), "reminders", "remind-order-43")))

	failed, out := capture(func(tb testing.TB) {
		env.RequireScheduled(tb, env.Exec(), "reminders", "remind-order-44")
	})
	require.True(t, failed)
	require.Contains(t, out, `want a message scheduled on topic "reminders" with dedup key "remind-order-44", found none.`)
	require.Contains(t, out, `dedup_key="remind-order-42"`)
	require.Contains(t, out, `dedup_key="remind-order-43" due=2030-01-02T03:04:05Z`)

	ok, err := env.Publisher.CancelScheduled(context.Background(), "reminders", "remind-order-42")
	require.NoError(t, err)
	require.True(t, ok)
	env.RequireNotPublished(t, env.Exec(), "reminders", pgoutboxtest.WithUUID(m.UUID))
}

func TestCollectFailsWithMissingCount(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	require.NoError(t, env.Publisher.Publish("orders", msg("only")))
	failed, out := capture(func(tb testing.TB) {
		pgoutboxtest.Drain(tb, env.Subscriber, "orders", 3, 2*time.Second)
	})
	require.True(t, failed)
	require.Contains(t, out, "received 1 of 3 message(s) within 2s; 2 missing.")
	require.Contains(t, out, `payload="only"`)

	ch := make(chan *message.Message)
	close(ch)
	failed, out = capture(func(tb testing.TB) { pgoutboxtest.Collect(tb, ch, 1, time.Second) })
	require.True(t, failed)
	require.Contains(t, out, "the channel closed after 0 of 1 message(s); 1 missing.")
}

// A test that binds a named group (CQRS handlers, BindSubscribers) and
// then drains with Env.Subscriber, of another group, waits for messages
// that went to the named group only: the failure says so.
func TestDrainSaysWhenOtherGroupsWereBoundFirst(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	require.NoError(t, pgoutbox.Bind(context.Background(), env.Exec(), env.Tables, "invoices", "billing"))
	require.NoError(t, env.Publisher.Publish("invoices", msg("for billing")))
	failed, out := capture(func(tb testing.TB) {
		env.Drain(tb, "invoices", 1, time.Second)
	})
	require.True(t, failed)
	require.Contains(t, out, "received 0 of 1 message(s)")
	require.Contains(t, out, `bound to the consumer group(s) "billing" before this subscriber's group ""`)
	require.Contains(t, out, "pgoutbox.StartFromBacklog")
	require.Contains(t, out, `the group(s) "billing": 1.`)

	// Drained by its own group, the same message arrives; and a drain that
	// only misses messages says nothing of groups.
	billing := env.NewSubscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = "billing" })
	require.Len(t, pgoutboxtest.Drain(t, billing, "invoices", 1, 30*time.Second), 1)
	failed, out = capture(func(tb testing.TB) {
		env.Drain(tb, "receipts", 1, time.Second)
	})
	require.True(t, failed)
	require.NotContains(t, out, "consumer group")
}

// Parallel tests each get a schema of their own: none sees another's rows.
func TestParallelTestsAreIsolated(t *testing.T) {
	t.Parallel()
	for i := range 8 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			env := pgoutboxtest.PubSub(t)
			payload := fmt.Sprintf("test-%d", i)
			require.NoError(t, env.Publisher.Publish("shared-topic", msg(payload), msg(payload)))
			got := env.RequirePublished(t, env.Exec(), "shared-topic", pgoutboxtest.Count(2))
			for _, m := range got {
				require.Equal(t, payload, string(m.Payload))
			}
			got = env.Drain(t, "shared-topic", 2, 30*time.Second)
			require.Equal(t, payload, string(got[0].Payload))
			env.RequireNotPublished(t, env.Exec(), "shared-topic")
		})
	}
}

// A schema is reused after its test ends, emptied; one whose shape the
// test changed is dropped instead.
func TestSchemaReuseAndCleanup(t *testing.T) {
	var first string
	t.Run("fill", func(t *testing.T) {
		env := pgoutboxtest.PubSub(t)
		first = env.Schema
		_, err := env.Pool.Exec(context.Background(), `COMMENT ON SCHEMA `+env.Schema+` IS 'used by fill'`)
		require.NoError(t, err)
		require.NoError(t, env.Publisher.Publish("t", msg("left behind")))
		// Enough rows that the tables are truncated rather than deleted from.
		_, err = env.Pool.Exec(context.Background(), `INSERT INTO outbox (topic, uuid, payload)
			SELECT 'bulk', gen_random_uuid()::text, '\x00' FROM generate_series(1, 1500)`)
		require.NoError(t, err)
		_, err = env.Pool.Exec(context.Background(), `INSERT INTO outbox_bindings (topic, consumer_group) VALUES ('t', 'g')`)
		require.NoError(t, err)
	})
	var reused string
	t.Run("reuse", func(t *testing.T) {
		env := pgoutboxtest.PubSub(t)
		reused = env.Schema
		var comment *string
		require.NoError(t, env.Pool.QueryRow(context.Background(), `SELECT obj_description($1::regnamespace, 'pg_namespace')`, env.Schema).Scan(&comment))
		require.NotNil(t, comment)
		require.Equal(t, "used by fill", *comment, "the schema of the previous test")
		env.RequireNotPublished(t, env.Exec(), "t")
		env.RequireNotPublished(t, env.Exec(), "bulk")
		var n int
		require.NoError(t, env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_bindings`).Scan(&n))
		require.Zero(t, n)
		// A table of the test's own, made through the pool's search_path.
		_, err := env.Pool.Exec(context.Background(), `CREATE TABLE orders (id int)`)
		require.NoError(t, err)
	})
	// Parallel tests wait for the serial ones: nobody took it in between.
	// A reused schema is renamed (a NOTIFY channel of its own per test).
	require.NotEqual(t, first, reused, "renamed")
	var exists bool
	require.NoError(t, pgoutboxtest.NewSchema(t, pgoutboxtest.Options{}).Pool.QueryRow(context.Background(),
		`SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, reused).Scan(&exists))
	require.False(t, exists, "a schema the test changed is dropped, not reused")
}

// A schema whose tables were analyzed is dropped, not reused: emptying
// keeps the statistics, and the next test's plans would be made for this
// test's rows.
func TestAnalyzedSchemaIsNotReused(t *testing.T) {
	var oid uint32
	t.Run("analyze", func(t *testing.T) {
		env := pgoutboxtest.PubSub(t)
		ctx := context.Background()
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT $1::regnamespace::oid`, env.Schema).Scan(&oid))
		_, err := env.Pool.Exec(ctx, `INSERT INTO outbox (topic, uuid, payload, ordering_key)
			SELECT 't', gen_random_uuid()::text, '\x00', 'k' FROM generate_series(1, 100)`)
		require.NoError(t, err)
		_, err = env.Pool.Exec(ctx, `ANALYZE outbox`)
		require.NoError(t, err)
	})
	var exists bool
	require.NoError(t, pgoutboxtest.NewSchema(t, pgoutboxtest.Options{}).Pool.QueryRow(context.Background(),
		`SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE oid = $1)`, oid).Scan(&exists))
	require.False(t, exists, "an analyzed schema is dropped, not reused")
}

func TestNewSchemaIsDropped(t *testing.T) {
	t.Parallel()
	var name string
	t.Run("make", func(t *testing.T) {
		s := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})
		name = s.Name
		require.True(t, strings.HasPrefix(name, pgoutboxtest.RunPrefix))
		_, err := s.Pool.Exec(context.Background(), `CREATE TABLE `+name+`.x (id int)`)
		require.NoError(t, err)
	})
	s := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})
	var exists bool
	require.NoError(t, s.Pool.QueryRow(context.Background(),
		`SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, name).Scan(&exists))
	require.False(t, exists)
}

func TestOptions(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{
		Table:             "events",
		NoDeadLetterTable: true,
		ConsumerGroup:     "svc",
		MaxInFlight:       4,
		Subscriber:        func(c *pgoutbox.SubscriberConfig) { c.WorkerID = "w1" },
	})
	cfg := env.SubscriberConfig()
	require.Equal(t, "svc", cfg.ConsumerGroup)
	require.Equal(t, 4, cfg.MaxInFlight)
	require.Equal(t, "w1", cfg.WorkerID)
	require.Equal(t, "events", env.Tables.Table)
	require.Empty(t, env.Tables.DeadLetterTable)
	require.NoError(t, env.Subscriber.SubscribeInitialize("orders"))
	require.NoError(t, env.Publisher.Publish("orders", msg("a")))
	env.RequirePublished(t, env.Exec(), "orders", pgoutboxtest.WithPayload([]byte("a")))
	require.Len(t, env.Drain(t, "orders", 1, 30*time.Second), 1)
}

// BenchmarkPubSub measures what PubSub adds to a test: taking a schema,
// opening the pool, building the publisher and subscriber, and at the end
// closing them and truncating the tables. "fresh" is the alternative it
// avoids: a new schema with the outbox tables created, dropped at the end.
func BenchmarkPubSub(b *testing.B) {
	b.Run("reused", func(b *testing.B) {
		for b.Loop() {
			f := &fakeTB{}
			env := pgoutboxtest.PubSub(f)
			require.NoError(b, env.Publisher.Publish("t", msg("x"))) // a dirty table to truncate
			f.cleanup()
			require.False(b, f.failed, f.logs)
		}
	})
	b.Run("fresh", func(b *testing.B) {
		for b.Loop() {
			f := &fakeTB{}
			s := pgoutboxtest.NewSchema(f, pgoutboxtest.Options{})
			tables := schema.Config{Schema: s.Name}
			require.NoError(b, schema.Create(context.Background(), tx.FromPgxPool(s.Pool), tables))
			pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(s.Pool), pgoutbox.PublisherConfig{Tables: tables}, nil)
			require.NoError(b, err)
			require.NoError(b, pub.Publish("t", msg("x")))
			f.cleanup()
			require.False(b, f.failed, f.logs)
		}
	})
}

// Helpers given arguments they cannot use fail the test saying so; they
// panicked (a negative count of messages, a nil executor) or took
// Count(-2) for "at least one".
func TestHelpersFailOnArgumentsTheyCannotUse(t *testing.T) {
	t.Parallel()
	for name, fn := range map[string]func(tb testing.TB){
		"Collect -1":           func(tb testing.TB) { pgoutboxtest.Collect(tb, make(chan *message.Message), -1, time.Millisecond) },
		"RequirePublished nil": func(tb testing.TB) { pgoutboxtest.RequirePublished(tb, nil, "t") },
		"Count -2":             func(tb testing.TB) { pgoutboxtest.RequirePublished(tb, nil, "t", pgoutboxtest.Count(-2)) },
	} {
		failed, out := capture(fn)
		require.True(t, failed, name)
		require.Contains(t, out, "pgoutboxtest", name)
		require.NotContains(t, out, "panic", name)
	}
	_, out := capture(func(tb testing.TB) { pgoutboxtest.RequirePublished(tb, nil, "t", pgoutboxtest.Count(-2)) })
	require.Contains(t, out, "Count(-2)")
	_, out = capture(func(tb testing.TB) { pgoutboxtest.RequirePublished(tb, nil, "t") })
	require.Contains(t, out, "the executor is nil")
}
