package tests

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// poolWith opens a pool of the test's database whose sessions have the
// settings given (as a role's or database's settings would), closed when
// the test ends; mod may change the rest of its config.
func (b *bundle) poolWith(t *testing.T, settings map[string]string, mod func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(b.DSN)
	require.NoError(t, err)
	for k, v := range settings {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	if mod != nil {
		mod(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// A database or role whose default_transaction_isolation is REPEATABLE
// READ (or SERIALIZABLE) must not make the subscriber's own claims and
// writes fail: competing lease claims met rows a competitor changed after
// their snapshot, failed with a serialization error, were logged as failed
// and backed off. Three competing subscribers, each on a pool of its own
// whose sessions default to REPEATABLE READ (as a role's setting would), on
// every claim mode, half of the messages keyed; every message is
// delivered, and no statement of theirs failed.
func TestCompetingSubscribersUnderARepeatableReadDefault(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		ctx := context.Background()
		const n, subscribers = 1500, 3
		msgs := newMsgs(n)
		for i, m := range msgs {
			if i%2 == 0 { // keyed claims verify their keys: more statements that meet competitors
				pgoutbox.WithOrderingKey(m, fmt.Sprint("k", i%40))
			}
		}
		require.NoError(t, b.poolPublisher(t).Publish("rr", msgs...))
		logs := &logCapture{}
		seen := &list{}
		for range subscribers {
			pool := b.poolWith(t, map[string]string{"default_transaction_isolation": "repeatable read"},
				func(c *pgxpool.Config) { c.MaxConns = 8 })
			var iso string
			require.NoError(t, pool.QueryRow(ctx, "SELECT current_setting('transaction_isolation')").Scan(&iso))
			require.Equal(t, "repeatable read", iso, "the pool's transactions default to REPEATABLE READ")
			sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
				Tables: b.tables, ClaimMode: mode, MaxInFlight: 4, Lease: 5 * time.Second,
				MinPollInterval: 10 * time.Millisecond, MaxPollInterval: 200 * time.Millisecond,
			}, logs)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			runRouter(t, sub, "rr", func(msg *message.Message) error {
				seen.add(string(msg.Payload))
				return nil
			})
		}
		pollUntil(t, "every message delivered", 60*time.Second, nil, func() bool { return b.outboxRows(t, "rr") == 0 })
		got := map[string]int{}
		for _, p := range seen.get() {
			got[p]++
		}
		require.Len(t, got, n)
		failed := logs.find("error", func(e logEntry) bool {
			return e.err != nil && (strings.Contains(e.err.Error(), "40001") || strings.Contains(e.err.Error(), "serialize"))
		})
		require.Empty(t, failed, "the subscribers' statements ran READ COMMITTED")
	})
}

// A read-only server or role (default_transaction_read_only, a standby
// reached after a failover) fails Publish and Subscribe with "cannot
// execute SELECT in a read-only transaction", which sent people looking at
// the query: the errors say what it means and what to do.
func TestAReadOnlyServerIsNamedAsSuch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pool := b.poolWith(t, map[string]string{"default_transaction_read_only": "on"}, nil)

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	err = pub.Publish("ro", newMsg("x"))
	require.ErrorContains(t, err, "25006")
	require.ErrorContains(t, err, "default_transaction_read_only is on for this role or database, or the connection reached a standby")

	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	_, err = sub.Subscribe(ctx, "ro")
	require.ErrorContains(t, err, "connect to the primary")
}

// A handler's transaction (tx.Middleware) has the pool's default isolation,
// as the transactional-handlers guide says, with either driver; pgoutbox's
// own transactions (tx.RunInTx) run READ COMMITTED whatever it is. The
// middleware once began READ COMMITTED too, silently weakening the
// SERIALIZABLE a service had chosen for its handlers' invariants.
func TestHandlerTransactionKeepsThePoolsIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool := b.poolWith(t, map[string]string{"default_transaction_isolation": "serializable"}, nil)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	level := func(t *testing.T, exec tx.Executor) string {
		t.Helper()
		rows, err := exec.Query(context.Background(), `SHOW transaction_isolation`)
		require.NoError(t, err)
		defer rows.Close()
		require.True(t, rows.Next())
		var l string
		require.NoError(t, rows.Scan(&l))
		return l
	}
	for name, exec := range map[string]tx.Executor{"pgxpool": tx.FromPgxPool(pool), "database/sql": tx.FromSQLDB(db)} {
		t.Run(name, func(t *testing.T) {
			mw, err := tx.Middleware(exec, tx.MiddlewareConfig{})
			require.NoError(t, err)
			var inHandler string
			_, err = mw(func(m *message.Message) ([]*message.Message, error) {
				e, ok := tx.ExecutorFromContext(m.Context())
				require.True(t, ok)
				inHandler = level(t, e)
				return nil, nil
			})(message.NewMessage("m", nil))
			require.NoError(t, err)
			require.Equal(t, "serializable", inHandler, "the handler's transaction")
			require.NoError(t, tx.RunInTx(context.Background(), exec, func(e tx.Executor) error {
				require.Equal(t, "read committed", level(t, e), "pgoutbox's own transaction")
				return nil
			}))
		})
	}
}

// A handler that drops the error of a failed statement and returns nil
// learns it from the middleware's error, whose completion or commit finds
// the transaction aborted: the error says what to do, not only SQLSTATE
// 25P02.
func TestTxMiddlewareNamesAStatementErrorTheHandlerDropped(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, err := tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{})
	require.NoError(t, err)
	_, err = mw(func(m *message.Message) ([]*message.Message, error) {
		pgTx, _ := tx.PgxTxFromContext(m.Context())
		_, _ = pgTx.Exec(m.Context(), `SELECT 1/0`) // dropped
		return nil, nil
	})(message.NewMessage("m", nil))
	require.ErrorContains(t, err, "a statement of the handler failed and the handler returned nil")
}

// A Publish through a pool whose sessions default to REPEATABLE READ or
// SERIALIZABLE, with a dedup key whose row another transaction changes
// while the insert waits for it (a consumer's claim or ack, a competing
// publisher): it failed with a serialization error, where READ COMMITTED
// takes the key as held and skips the message. The pool's own publishes
// now run READ COMMITTED, as the subscriber's statements do; the first
// learns the default, the later ones too.
func TestPoolPublishWithADedupKeyUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			pool := b.poolWith(t, map[string]string{"default_transaction_isolation": level}, nil)
			pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
			require.NoError(t, err)
			keyed := func(key string) *message.Message {
				m := newMsg(key)
				pgoutbox.WithDedupKey(m, key)
				return m
			}
			for round, key := range []string{"k1", "k2"} {
				require.NoError(t, pub.Publish("rr-dedup", keyed(key)))
				changer, err := b.Pool.Begin(ctx)
				require.NoError(t, err)
				t.Cleanup(func() { _ = changer.Rollback(context.Background()) })
				_, err = changer.Exec(ctx, `UPDATE `+b.Schema+`.outbox SET deliveries = deliveries + 1 WHERE dedup_key = $1`, key)
				require.NoError(t, err)
				var pid int
				require.NoError(t, changer.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))

				done := make(chan error, 1)
				go func() { done <- pub.Publish("rr-dedup", keyed(key)) }()
				pollUntil(t, "the publish waits for the changed row", 10*time.Second, nil, func() bool {
					return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid))`, pid) > 0
				})
				require.NoError(t, changer.Commit(ctx))
				require.NoError(t, <-done, "round %d: the duplicate is skipped, not failed", round)
			}
			require.Equal(t, 2, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = 'rr-dedup'`))
		})
	}
}

// A pool whose sessions convert text from LATIN1 (a legacy database's
// default, a role's setting): pgx sends UTF-8 whatever the setting, so a
// non-ASCII topic matched nothing a connection with UTF8 stored (lib/pq,
// psql), and metadata came back altered, silently. Between pgx
// connections alike it round-trips, so Subscribe goes on, and says what
// to set on every connection.
func TestSubscribeWarnsOfAPoolThatIsNotUTF8(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool := b.poolWith(t, map[string]string{"client_encoding": "LATIN1"}, nil)
	logs := &logCapture{}
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables}, logs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, "bestellung.grün")
	require.NoError(t, err)
	require.Len(t, logs.find("info", func(e logEntry) bool {
		return strings.Contains(e.msg, "set client_encoding=UTF8 on every connection") && e.fields["client_encoding"] == "LATIN1"
	}), 1)
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("bestellung.grün", newMsgs(1)...))
	receive(t, msgs, 10*time.Second).Ack()
}
