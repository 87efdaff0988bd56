package tests

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// sqlDB opens a database/sql pool on the test database with the pgx stdlib
// driver, closed when the test ends.
func (b *bundle) sqlDB(t *testing.T) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", b.DSN)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.PingContext(context.Background()))
	return db
}

// txForm is one way of binding a Publisher to a caller's transaction.
type txForm struct {
	name string
	// begin opens a transaction and returns a publisher bound to it, with
	// the transaction's commit and rollback.
	begin func(t *testing.T, b *bundle) (pub *pgoutbox.Publisher, commit, rollback func() error)
}

func txForms() []txForm {
	sqlTx := func(wrap func(*testing.T, *bundle, *sql.Tx) *pgoutbox.Publisher) func(*testing.T, *bundle) (*pgoutbox.Publisher, func() error, func() error) {
		return func(t *testing.T, b *bundle) (*pgoutbox.Publisher, func() error, func() error) {
			t.Helper()
			st, err := b.sqlDB(t).BeginTx(context.Background(), nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = st.Rollback() })
			return wrap(t, b, st), st.Commit, st.Rollback
		}
	}
	return []txForm{
		{"FromSQLTx", sqlTx(func(t *testing.T, b *bundle, st *sql.Tx) *pgoutbox.Publisher {
			pub, err := pgoutbox.NewPublisher(tx.FromSQLTx(st), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
			require.NoError(t, err)
			return pub
		})},
		{"NewTxPublisher", sqlTx(func(t *testing.T, b *bundle, st *sql.Tx) *pgoutbox.Publisher {
			pub, err := pgoutbox.NewTxPublisher(st, pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
			require.NoError(t, err)
			return pub
		})},
		{"FromPgxTx", func(t *testing.T, b *bundle) (*pgoutbox.Publisher, func() error, func() error) {
			t.Helper()
			ctx := context.Background()
			pt, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = pt.Rollback(ctx) })
			pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pt), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
			require.NoError(t, err)
			return pub, func() error { return pt.Commit(ctx) }, func() error { return pt.Rollback(ctx) }
		}},
	}
}

// poolForms are the executors that commit each Publish on its own.
func poolForms() map[string]func(t *testing.T, b *bundle) *pgoutbox.Publisher {
	return map[string]func(t *testing.T, b *bundle) *pgoutbox.Publisher{
		"FromSQLDB": func(t *testing.T, b *bundle) *pgoutbox.Publisher {
			pub, err := pgoutbox.NewPublisher(tx.FromSQLDB(b.sqlDB(t)), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
			require.NoError(t, err)
			return pub
		},
		"FromPgxPool": func(t *testing.T, b *bundle) *pgoutbox.Publisher {
			return b.poolPublisher(t)
		},
	}
}

// testMessages returns n messages with distinct payloads and metadata.
func testMessages(n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = newMsg(fmt.Sprintf("payload %d", i))
		msgs[i].Metadata.Set("index", fmt.Sprint(i))
		msgs[i].Metadata.Set("unicode", "grüße ✓")
	}
	return msgs
}

// requireDelivered subscribes to topic and requires the sent messages to
// arrive in order with the same UUID, payload and metadata; it acks each.
func requireDelivered(t *testing.T, b *bundle, topic string, sent []*message.Message) {
	t.Helper()
	ch, err := b.subscriber(t, nil).Subscribe(t.Context(), topic)
	require.NoError(t, err)
	for _, want := range sent {
		got := receive(t, ch, 10*time.Second)
		require.Equal(t, want.UUID, got.UUID)
		require.Equal(t, string(want.Payload), string(got.Payload))
		require.Equal(t, want.Metadata, got.Metadata)
		got.Ack()
	}
}

func TestPublishInTxRollbackWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, form := range txForms() {
		t.Run(form.name, func(t *testing.T) {
			t.Parallel()
			topic := "rollback_" + form.name
			pub, _, rollback := form.begin(t, b)
			require.NoError(t, pub.Publish(topic, testMessages(3)...))
			require.NoError(t, rollback())
			require.Equal(t, 0, b.outboxRows(t, topic))
		})
	}
}

func TestPublishInTxCommit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, form := range txForms() {
		t.Run(form.name, func(t *testing.T) {
			t.Parallel()
			topic := "commit_" + form.name
			pub, commit, _ := form.begin(t, b)
			sent := testMessages(3)
			require.NoError(t, pub.Publish(topic, sent...))
			// The publisher never commits: another connection sees nothing
			// until the caller does.
			require.Equal(t, 0, b.outboxRows(t, topic))
			require.NoError(t, pub.Close(), "Close on a tx-bound publisher leaves the tx alone")
			require.Equal(t, 0, b.outboxRows(t, topic))
			require.NoError(t, commit())
			require.Equal(t, 3, b.outboxRows(t, topic))
			requireDelivered(t, b, topic, sent)
		})
	}
}

func TestPublishThroughPool(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for name, newPub := range poolForms() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			topic := "pool_" + name
			sent := testMessages(3)
			require.NoError(t, newPub(t, b).Publish(topic, sent...))
			require.Equal(t, 3, b.outboxRows(t, topic), "committed on its own")
			requireDelivered(t, b, topic, sent)
		})
	}
}

func TestPublishAfterTxEndReturnsErrTxDone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, form := range txForms() {
		for _, end := range []string{"Commit", "Rollback"} {
			t.Run(form.name+"/"+end, func(t *testing.T) {
				t.Parallel()
				topic := "done_" + form.name + "_" + end
				pub, commit, rollback := form.begin(t, b)
				require.NoError(t, pub.Publish(topic, newMsg("in time")))
				if end == "Commit" {
					require.NoError(t, commit())
				} else {
					require.NoError(t, rollback())
				}
				err := pub.Publish(topic, newMsg("too late"))
				require.ErrorIs(t, err, pgoutbox.ErrTxDone)
				require.Contains(t, err.Error(), "before Commit", "the error says what to do")
				want := 0
				if end == "Commit" {
					want = 1
				}
				require.Equal(t, want, b.outboxRows(t, topic))
			})
		}
	}
}

// TestPublishBatch checks that one Publish call of 100 messages keeps call
// order in the ids and is written by one statement: rows inserted by one
// statement share their transaction id (xmin) and command id (cmin).
func TestPublishBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const topic = "batch"

	// A second statement in the same transaction first, so the batch's
	// command id would differ from its neighbours' if it were split.
	pt, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = pt.Rollback(ctx) }()
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pt), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("other", newMsg("before")))

	sent := testMessages(100)
	res, err := pub.PublishWithResult(topic, sent...)
	require.NoError(t, err)
	require.Len(t, res.IDs, 100)
	require.Empty(t, res.Skipped())
	for i := 1; i < len(res.IDs); i++ {
		require.Greater(t, res.IDs[i], res.IDs[i-1], "ids follow call order")
	}
	require.NoError(t, pt.Commit(ctx))

	rows, err := b.Pool.Query(ctx, `SELECT id, uuid FROM `+b.Schema+`.outbox WHERE topic = $1 ORDER BY id`, topic)
	require.NoError(t, err)
	type row struct {
		ID   int64
		UUID string
	}
	stored, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	require.Len(t, stored, 100)
	for i, r := range stored {
		require.Equal(t, sent[i].UUID, r.UUID, "row %d", i)
		require.Equal(t, res.IDs[i], r.ID, "row %d", i)
	}

	var statements int
	require.NoError(t, b.Pool.QueryRow(ctx,
		`SELECT count(DISTINCT (xmin::text, cmin::text)) FROM `+b.Schema+`.outbox WHERE topic = $1`, topic).Scan(&statements))
	require.Equal(t, 1, statements, "the batch is inserted by one statement")
	// The measure tells statements apart: the earlier Publish in the same
	// transaction has the same xmin but another cmin.
	require.NoError(t, b.Pool.QueryRow(ctx,
		`SELECT count(DISTINCT (xmin::text, cmin::text)) FROM `+b.Schema+`.outbox`).Scan(&statements))
	require.Equal(t, 2, statements)
}

// A publisher bound to a transaction refuses to publish after Close; one
// through a pool ignores Close (see the test below).
func TestPublisherClose(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pgTx, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	defer pgTx.Rollback(ctx) //nolint:errcheck // committed below
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("close", newMsg("open")))
	require.NoError(t, pub.Close())
	require.NoError(t, pub.Close(), "Close is idempotent")
	err = pub.Publish("close", newMsg("closed"))
	require.ErrorIs(t, err, pgoutbox.ErrPublisherClosed)
	require.Contains(t, err.Error(), "create a new publisher")
	_, err = pub.PublishWithResult("close", newMsg("closed"))
	require.ErrorIs(t, err, pgoutbox.ErrPublisherClosed)
	require.NoError(t, pgTx.Commit(ctx))
	require.Equal(t, 1, b.outboxRows(t, "close"))

	pooled := b.poolPublisher(t)
	require.NoError(t, pooled.Close())
	require.NoError(t, pooled.Publish("close", newMsg("after close")), "a publisher through a pool ignores Close")
	require.Equal(t, 2, b.outboxRows(t, "close"))
}

// closeSignal is a publisher that reports the Router's Close of it.
type closeSignal struct {
	message.Publisher
	closed chan struct{}
}

func (p *closeSignal) Close() error {
	select {
	case <-p.closed:
	default:
		close(p.closed)
	}
	return p.Publisher.Close()
}

// One publisher through a pool given to two handlers, as Watermill users
// share one: the Router closes it when the first handler stops, while
// the other still drains its message. That message's output is published
// and its row acked, not nacked for a redelivery.
func TestPublisherSharedByHandlersOutlivesTheFirstHandlersStop(t *testing.T) {
	t.Parallel()
	b := setup(t)
	shared := &closeSignal{Publisher: b.poolPublisher(t), closed: make(chan struct{})}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, nil)
	require.NoError(t, err)
	r.AddHandler("idle", "idle.in", b.subscriber(t, nil), "idle.out", shared, func(m *message.Message) ([]*message.Message, error) {
		return nil, nil
	})
	working := make(chan struct{})
	r.AddHandler("draining", "work.in", b.subscriber(t, nil), "work.out", shared, func(m *message.Message) ([]*message.Message, error) {
		close(working)
		select {
		case <-shared.closed: // the idle handler stopped, and its publisher with it
		case <-time.After(15 * time.Second):
			return nil, errors.New("the Router never closed the idle handler's publisher")
		}
		return []*message.Message{newMsg("output")}, nil
	})
	r.AddMiddleware(pgoutbox.ErrorRecorder)
	running := make(chan error, 1)
	go func() { running <- r.Run(context.Background()) }()
	<-r.Running()
	b.publishInTx(t, "work.in", true, newMsg("work"))
	<-working
	require.NoError(t, r.Close())
	require.NoError(t, <-running)
	require.Equal(t, 1, b.outboxRows(t, "work.out"), "the draining handler's output is published")
	require.Equal(t, 0, b.outboxRows(t, "work.in"), "and its message acked")
	require.NoError(t, shared.Publish("idle.in", newMsg("later")), "the service goes on publishing with it")
}

func TestPublishNoMessages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for name, newPub := range poolForms() {
		pub := newPub(t, b)
		require.NoError(t, pub.Publish("empty_"+name), name)
		res, err := pub.PublishWithResult("empty_" + name)
		require.NoError(t, err, name)
		require.Empty(t, res.IDs)
	}
	for _, form := range txForms() {
		pub, commit, _ := form.begin(t, b)
		require.NoError(t, pub.Publish("empty_"+form.name), form.name)
		require.NoError(t, commit())
	}
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox`))
}

// A pool Publish that returns its StatementTimeout wrote nothing. The
// bound was the client's alone: the server went on with the statement
// (here waiting for a dedup key another transaction holds) until the
// cancel request reached it, and committed it when that transaction
// rolled back first (10 of 10 times with the rollback right after the
// error; through database/sql 8 of 9). The server now bounds it, through
// either kind of pool, and the error says so.
func TestAPoolPublishThatTimedOutWroteNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pools := map[string]tx.Executor{"pgx": tx.FromPgxPool(b.Pool), "database/sql": tx.FromSQLDB(b.sqlDB(t))}
	for name, pool := range pools {
		t.Run(name, func(t *testing.T) { publishTimedOutWroteNothing(t, b, pool) })
	}
}

// A pool Publish that got no answer (the path to the server held what it
// sent) said only "context deadline exceeded", while its statement may
// run when the path delivers it, and write the message: through a pgx
// pool, whose one batch carries the statement and its commit. It says
// that the message may have been written (tx.ErrOutcomeUnknown). Through
// database/sql, whose BEGIN got no answer, nothing was sent to commit: it
// does not say so.
func TestAPoolPublishWithoutAnAnswerSaysWhetherItMayHaveWritten(t *testing.T) {
	t.Parallel()
	b := setup(t)
	px := startTCPProxy(t, b.DSN)
	pool := px.pool(t, b, "no-answer-"+b.Schema, nil)
	warmUpPool(t, pool, 1)
	db, err := sql.Open("pgx", viaProxy(t, b.DSN, px.addr, "no-answer-"+b.Schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.PingContext(context.Background()))
	publish := func(exec tx.Executor) error {
		pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: b.tables, StatementTimeout: 200 * time.Millisecond}, nil)
		require.NoError(t, err)
		return pub.Publish("t", newMsg("unanswered"))
	}
	px.hold(time.Hour)

	err = publish(tx.FromPgxPool(pool))
	require.ErrorIs(t, err, tx.ErrOutcomeUnknown)
	require.ErrorContains(t, err, "may have been written all the same")
	require.ErrorContains(t, err, "WithDedupKey")

	err = publish(tx.FromSQLDB(db))
	require.Error(t, err)
	require.NotErrorIs(t, err, tx.ErrOutcomeUnknown)
	require.NotContains(t, err.Error(), "may have been written")

	// A pgx pool whose connection cannot be made: nothing was sent, and
	// the pool's handlers are not blamed.
	pool.Reset()
	err = publish(tx.FromPgxPool(pool))
	require.ErrorIs(t, err, tx.ErrNoConnection)
	require.ErrorContains(t, err, "a new connection to the database was not made")
	require.NotContains(t, err.Error(), "handlers hold them")
}

// A pool Publish that found every connection taken until its bound says
// so (it never ran: nothing was written), on both pools: it said only
// "context deadline exceeded", which sent people to the server.
func TestAPoolPublishWithoutAFreeConnectionSaysSo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	one := b.poolWith(t, nil, func(c *pgxpool.Config) { c.MaxConns = 1 })
	db := b.sqlDB(t)
	db.SetMaxOpenConns(1)
	type holder struct {
		exec tx.Executor
		hold func() func()
	}
	for name, h := range map[string]holder{
		"pgx": {tx.FromPgxPool(one), func() func() {
			c, err := one.Acquire(ctx)
			require.NoError(t, err)
			return c.Release
		}},
		"database/sql": {tx.FromSQLDB(db), func() func() {
			c, err := db.Conn(ctx)
			require.NoError(t, err)
			return func() { _ = c.Close() }
		}},
	} {
		t.Run(name, func(t *testing.T) {
			release := h.hold()
			pub, err := pgoutbox.NewPublisher(h.exec, pgoutbox.PublisherConfig{Tables: b.tables, StatementTimeout: 100 * time.Millisecond}, nil)
			require.NoError(t, err)
			m := newMsg("waits")
			err = pub.Publish("t", m)
			release()
			require.ErrorIs(t, err, tx.ErrNoConnection)
			require.ErrorContains(t, err, "1 of 1 in use")
			require.Equal(t, 1, strings.Count(err.Error(), "pgoutbox:"), err.Error())
			require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE uuid = $1`, m.UUID))
			require.NoError(t, pub.Publish("t", newMsg("after")), "the pool works once a connection is free")
		})
	}
}

func publishTimedOutWroteNothing(t *testing.T, b *bundle, pool tx.Executor) {
	ctx := context.Background()
	for i := range 5 {
		holder, err := b.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = holder.Rollback(context.Background()) }) // a failed check must not leave it holding the key
		held, err := pgoutbox.NewPublisher(tx.FromPgxTx(holder), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
		require.NoError(t, err)
		first := newMsg("held")
		pgoutbox.WithDedupKey(first, "x")
		require.NoError(t, held.Publish("t", first))

		pub, err := pgoutbox.NewPublisher(pool, pgoutbox.PublisherConfig{Tables: b.tables, StatementTimeout: 200 * time.Millisecond}, nil)
		require.NoError(t, err)
		late := newMsg("timed out")
		pgoutbox.WithDedupKey(late, "x")
		err = pub.Publish("t", late)
		require.ErrorContains(t, err, "PublisherConfig.StatementTimeout, 200ms", "iteration %d", i)
		require.ErrorContains(t, err, "nothing was written")
		require.NoError(t, holder.Rollback(ctx))

		requireNeverWritten(t, b, late, "iteration %d: the Publish returned %q, and its message was written", i, err)
	}
}

// requireNeverWritten waits until nothing of the bundle's schema runs in
// the server any more (what it still ran of a Publish that failed ends
// once what held it up went away), then checks that m was not written.
func requireNeverWritten(t *testing.T, b *bundle, m *message.Message, msgAndArgs ...any) {
	t.Helper()
	pollUntil(t, "no other statement running in the database", 5*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND state = 'active' AND pid <> pg_backend_pid() AND query LIKE '%`+b.Schema+`%'`) == 0
	})
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE uuid = $1`, m.UUID), msgAndArgs...)
}

// A panic in RunInTx's function rolls its transaction back before it goes
// on up: a caller that recovers panics (a server, a test) kept the
// connection, and every lock taken in it, for good.
func TestRunInTxRollsBackOnPanic(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for name, exec := range map[string]tx.Executor{"pgxpool": tx.FromPgxPool(b.Pool), "database/sql": tx.FromSQLDB(b.sqlDB(t))} {
		t.Run(name, func(t *testing.T) {
			require.PanicsWithValue(t, "boom", func() {
				_ = tx.RunInTx(ctx, exec, func(e tx.Executor) error {
					_, err := e.Exec(ctx, `SELECT pg_advisory_xact_lock(4242)`)
					require.NoError(t, err)
					panic("boom")
				})
			})
			var free bool
			require.NoError(t, b.Pool.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(4242)`).Scan(&free))
			require.True(t, free, "the lock went with the rolled-back transaction")
		})
	}
}

// A pool Publish's bound covers its wait for a connection too. The server
// bound each statement by the whole StatementTimeout, set once the
// connection came, so after a long wait the client's bound (a second
// longer than StatementTimeout from the start) fired first, while the
// server still ran the statement (waiting for a dedup key another
// transaction held): the error said the database did not answer and the
// message may have been written (tx.ErrOutcomeUnknown), and the statement
// could commit after that. The server's bound is now what the wait left:
// the error says nothing was written, and nothing is. A wait that used
// the whole bound sends nothing, and says so (tx.ErrNoConnection).
func TestAPoolPublishThatWaitedForAConnectionIsBoundedByTheServer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const st = 1500 * time.Millisecond
	type onePool struct {
		exec tx.Executor
		hold func(t *testing.T) (release func())
	}
	pools := map[string]func(t *testing.T) onePool{
		"pgx": func(t *testing.T) onePool {
			pool := b.poolWith(t, nil, func(c *pgxpool.Config) { c.MaxConns = 1 })
			return onePool{tx.FromPgxPool(pool), func(t *testing.T) func() {
				conn, err := pool.Acquire(ctx)
				require.NoError(t, err)
				return conn.Release
			}}
		},
		"database/sql": func(t *testing.T) onePool {
			db := b.sqlDB(t)
			db.SetMaxOpenConns(1)
			return onePool{tx.FromSQLDB(db), func(t *testing.T) func() {
				conn, err := db.Conn(ctx)
				require.NoError(t, err)
				return func() { _ = conn.Close() }
			}}
		},
	}
	for name, newPool := range pools {
		t.Run(name, func(t *testing.T) {
			p := newPool(t)
			pub, err := pgoutbox.NewPublisher(p.exec, pgoutbox.PublisherConfig{Tables: b.tables, StatementTimeout: st}, nil)
			require.NoError(t, err)

			holder, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
			held, err := pgoutbox.NewPublisher(tx.FromPgxTx(holder), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
			require.NoError(t, err)
			key := "waited-" + name
			first := newMsg("held")
			pgoutbox.WithDedupKey(first, key)
			require.NoError(t, held.Publish("t", first))

			// A handler holds the pool's one connection for most of the bound.
			release := p.hold(t)
			time.AfterFunc(st-400*time.Millisecond, release)
			late := newMsg("waited")
			pgoutbox.WithDedupKey(late, key)
			err = pub.Publish("t", late)
			require.Error(t, err)
			require.NotErrorIs(t, err, tx.ErrOutcomeUnknown)
			require.ErrorContains(t, err, "nothing was written")
			require.NoError(t, holder.Rollback(ctx))
			requireNeverWritten(t, b, late, "the Publish returned %q, and its message was written", err)

			// A wait that outlasts the bound, but not the client's moment
			// after it: the connection comes too late to send anything.
			release = p.hold(t)
			time.AfterFunc(st+300*time.Millisecond, release)
			lost := newMsg("too late")
			err = pub.Publish("t", lost)
			require.ErrorIs(t, err, tx.ErrNoConnection)
			require.NotErrorIs(t, err, tx.ErrOutcomeUnknown)
			require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE uuid = '`+lost.UUID+`'`))
		})
	}
}
