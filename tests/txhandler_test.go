package tests

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// txHandlerBed is an outbox with a domain table (a counter) and the parts
// of a transactional handler: a context publisher and tx.Middleware.
type txHandlerBed struct {
	*bundle
	pool *pgxpool.Pool // the consumer's: subscribers, handler transactions
	pub  *pgoutbox.Publisher
	mw   message.HandlerMiddleware
}

func newTxHandlerBed(t *testing.T, pool *pgxpool.Pool, b *bundle) *txHandlerBed {
	t.Helper()
	_, err := b.Pool.Exec(context.Background(), `CREATE TABLE `+b.Schema+`.counter (id int PRIMARY KEY, n int NOT NULL);
		INSERT INTO `+b.Schema+`.counter VALUES (1, 0)`)
	require.NoError(t, err)
	pub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	mw, err := tx.Middleware(tx.FromPgxPool(pool), tx.MiddlewareConfig{Publisher: pub})
	require.NoError(t, err)
	return &txHandlerBed{bundle: b, pool: pool, pub: pub, mw: mw}
}

func (b *txHandlerBed) counter(t *testing.T) int {
	return b.count(t, `SELECT n FROM `+b.Schema+`.counter WHERE id = 1`)
}

// increment is the handler's domain write, in the handler's transaction.
func (b *txHandlerBed) increment(m *message.Message) error {
	pgTx, ok := tx.PgxTxFromContext(m.Context())
	if !ok {
		return errors.New("no transaction in the handler's context")
	}
	_, err := pgTx.Exec(m.Context(), `UPDATE `+b.Schema+`.counter SET n = n + 1 WHERE id = 1`)
	return err
}

func (b *txHandlerBed) newSubscriber(t *testing.T, mod func(*pgoutbox.SubscriberConfig)) *pgoutbox.Subscriber {
	t.Helper()
	cfg := pgoutbox.SubscriberConfig{
		Tables:          b.tables,
		Lease:           2 * time.Second,
		MinPollInterval: 20 * time.Millisecond,
		MaxPollInterval: time.Second,
		DrainTimeout:    2 * time.Second,
		RetryPolicy:     pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: -1},
	}
	if mod != nil {
		mod(&cfg)
	}
	sub, err := pgoutbox.NewSubscriber(b.pool, cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// The test of effectively-once processing. 1,000 messages go
// through tx.Middleware; the handler increments a counter row and returns
// one output message, in the handler's transaction. Faults: the handler
// fails on a random 10% of its calls, the consumer's connections
// (subscriber and handler transactions alike) are terminated every
// 100-300 ms, and the first consumer is closed mid-run while a second one
// takes over. Whatever was retried, lost or redelivered, the counter ends
// at exactly 1,000, with exactly 1,000 output rows and no input row left.
func TestTxMiddlewareEffectivelyOnceUnderFaults(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	ctx := context.Background()
	const n = 1000

	appName := "pgoutbox-txmw-" + b.Schema
	poolCfg, err := pgxpool.ParseConfig(b.DSN)
	require.NoError(t, err)
	poolCfg.MaxConns = 20
	poolCfg.ConnConfig.RuntimeParams["application_name"] = appName
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	h := newTxHandlerBed(t, pool, b)

	var handlerCalls, injected atomic.Int64
	handler := func(m *message.Message) ([]*message.Message, error) {
		handlerCalls.Add(1)
		if rand.N(10) == 0 {
			injected.Add(1)
			return nil, errors.New("injected handler failure")
		}
		if err := h.increment(m); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), m.Payload)}, nil
	}
	startConsumer := func(sub *pgoutbox.Subscriber) (*message.Router, chan error) {
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		r.AddMiddleware(h.mw)
		r.AddHandler("count", "in", sub, "out", h.pub, handler)
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		select {
		case <-r.Running():
		case err := <-done:
			t.Fatalf("the Router did not start: %v", err)
		}
		return r, done
	}

	first, firstDone := startConsumer(h.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) { c.MaxInFlight = 8 }))
	k := startKiller(b.Pool, appName)
	t.Cleanup(k.stop)
	// Ten batches; before each, a round of terminations, and after the
	// fifth a second consumer starts and the first one is closed.
	pub := b.poolPublisher(t)
	second, secondDone := (*message.Router)(nil), chan error(nil)
	for i := range 10 {
		select {
		case <-k.round:
		case <-time.After(10 * time.Second):
			t.Fatal("no round of terminations")
		}
		require.NoError(t, pub.Publish("in", newMsgs(n/10)...))
		if i == 4 {
			second, secondDone = startConsumer(h.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) { c.MaxInFlight = 4 }))
			require.NoError(t, first.Close())
			require.NoError(t, <-firstDone)
		}
	}
	t.Cleanup(func() {
		require.NoError(t, second.Close())
		require.NoError(t, <-secondDone)
	})

	pollUntil(t, "every input row processed", 2*time.Minute, nil, func() bool {
		return b.outboxRows(t, "in") == 0
	})
	k.stop()
	require.NoError(t, k.err)
	t.Logf("handler calls %d (injected failures %d), termination rounds %d", handlerCalls.Load(), injected.Load(), k.count.Load())
	require.Positive(t, injected.Load())
	require.GreaterOrEqual(t, k.count.Load(), int64(10), "connections were terminated while messages flowed")
	require.Equal(t, n, h.counter(t), "each message counted exactly once")
	require.Equal(t, n, b.outboxRows(t, "out"), "each message's output published exactly once")
}

// A lease lost while the handler runs (another consumer holds the message
// now) rolls the handler's transaction back: its domain write and output
// message with it. The handler gets ErrLeaseLost; the new holder
// processes the message.
func TestTxMiddlewareLeaseLostRollsBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	h := newTxHandlerBed(t, b.Pool, b)
	ctx := context.Background()
	var calls atomic.Int32
	type attempt struct {
		err            error
		counter, outer int
	}
	first := make(chan attempt, 1)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc { // outside tx.Middleware: sees its result
		return func(m *message.Message) ([]*message.Message, error) {
			produced, err := next(m)
			if calls.Load() == 1 {
				select {
				case first <- attempt{err: err, counter: h.counter(t), outer: b.outboxRows(t, "out")}:
				default:
				}
			}
			return produced, err
		}
	})
	r.AddMiddleware(h.mw)
	r.AddHandler("count", "in", h.newSubscriber(t, nil), "out", h.pub, func(m *message.Message) ([]*message.Message, error) {
		if err := h.increment(m); err != nil {
			return nil, err
		}
		if calls.Add(1) == 1 {
			// Meanwhile the lease expired and another consumer claimed the
			// row (a new token, a lease that ends in a second).
			_, err := b.Pool.Exec(ctx, `UPDATE `+b.Schema+`.outbox SET lease_token = gen_random_uuid(),
				leased_until = now() + interval '1 second' WHERE topic = 'in'`)
			if err != nil {
				return nil, err
			}
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("output"))}, nil
	})
	startRouter(t, r)
	b.publishInTx(t, "in", true, newMsg("x"))

	var a attempt
	select {
	case a = <-first:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not run")
	}
	require.ErrorIs(t, a.err, tx.ErrLeaseLost)
	require.Zero(t, a.counter, "the domain write rolled back")
	require.Zero(t, a.outer, "the output message rolled back")
	// The "other consumer" never completes; once its lease expires the
	// message is delivered again and processed once.
	pollUntil(t, "processed after the lease expired", 20*time.Second, nil, func() bool { return b.outboxRows(t, "in") == 0 })
	require.Equal(t, 1, h.counter(t))
	require.Equal(t, 1, b.outboxRows(t, "out"))
}

// The success path, and what the subscriber does after it: the row was
// deleted in the handler's transaction, so the Ack writes nothing (no
// lease is reported lost, before or after), and the message counts as
// acked.
func TestTxMiddlewareCommitsWriteOutputAndCompletion(t *testing.T) {
	t.Parallel()
	b := setup(t)
	h := newTxHandlerBed(t, b.Pool, b)
	ev := newEvents()
	sub := h.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.Observer = ev
		c.Lease, c.StatementTimeout = time.Second, 400*time.Millisecond // renewals every 500 ms, while the handler waits
		c.MinPollInterval, c.MaxPollInterval = 20*time.Millisecond, 100*time.Millisecond
	})
	slow := make(chan struct{})
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(h.mw)
	r.AddHandler("count", "in", sub, "out", h.pub, func(m *message.Message) ([]*message.Message, error) {
		if err := h.increment(m); err != nil {
			return nil, err
		}
		if string(m.Payload) == "slow" {
			<-slow // renewals of the held row run meanwhile
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("out of "+string(m.Payload)))}, nil
	})
	startRouter(t, r)
	b.publishInTx(t, "in", true, newMsg("slow"), newMsg("fast"))
	ev.wait(t, pgoutbox.EventLeaseRenewed, 10*time.Second)
	close(slow)
	pollUntil(t, "both acked", 10*time.Second, nil, func() bool { return ev.countKind(pgoutbox.EventAcked) == 2 })
	require.Equal(t, 2, h.counter(t))
	require.Zero(t, b.outboxRows(t, "in"))
	require.Equal(t, 2, b.outboxRows(t, "out"))
	// A few more renewal periods: nothing may report the deleted rows lost.
	ev.wait(t, pgoutbox.EventClaimed, 10*time.Second)
	ev.wait(t, pgoutbox.EventClaimed, 10*time.Second)
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
}

// A handler that goes on in a transaction an earlier statement aborted
// (Retry inside tx.Middleware runs every attempt in it) fails with a hint
// at the middleware order, not only PostgreSQL's "current transaction is
// aborted".
func TestTxMiddlewareNamesTheOrderWhenItsTransactionIsAborted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, err := tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{})
	require.NoError(t, err)
	attempts := 0
	handler := func(m *message.Message) ([]*message.Message, error) {
		e, _ := tx.ExecutorFromContext(m.Context())
		attempts++
		if attempts == 1 {
			_, err := e.Exec(m.Context(), `SELECT 1/0`)
			return nil, err
		}
		_, err := e.Exec(m.Context(), `SELECT 1`)
		return nil, err
	}
	retried := middleware.Retry{MaxRetries: 1}.Middleware(handler)
	_, err = mw(retried)(newMsg("x"))
	require.Equal(t, 2, attempts)
	require.ErrorContains(t, err, "current transaction is aborted")
	require.ErrorContains(t, err, "put it outside")
}

// Without a Publisher, a handler that returns messages fails clearly (and
// rolls back) rather than lose them or publish them outside its
// transaction; a transaction-bound executor is refused at construction.
func TestTxMiddlewareConfigErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := tx.Middleware(tx.FromPgxTx(nil), tx.MiddlewareConfig{})
	require.ErrorContains(t, err, "FromPgxPool")
	// A bare number is nanoseconds: every commit would time out.
	_, err = tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{CommitTimeout: 30})
	require.ErrorContains(t, err, "CommitTimeout is 30ns; it must be at least 1ms (a bare number is nanoseconds: write 30 * time.Second")
	mw, err := tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{})
	require.NoError(t, err)
	m := newMsg("x")
	_, err = mw(func(m *message.Message) ([]*message.Message, error) {
		return []*message.Message{newMsg("y")}, nil
	})(m)
	require.ErrorContains(t, err, "MiddlewareConfig.Publisher")
	_, ok := tx.ExecutorFromContext(m.Context())
	require.False(t, ok, "the message gets its own context back")

	// The transaction at hand, passed by mistake, is named as such.
	ctx := context.Background()
	pgTx, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	defer pgTx.Rollback(ctx) //nolint:errcheck // only begun to be refused
	sqlTx, err := b.sqlDB(t).BeginTx(ctx, nil)
	require.NoError(t, err)
	defer sqlTx.Rollback() //nolint:errcheck // only begun to be refused
	for name, e := range map[string]tx.Executor{"FromPgxTx": tx.FromPgxTx(pgTx), "FromSQLTx": tx.FromSQLTx(sqlTx)} {
		_, err = tx.Middleware(e, tx.MiddlewareConfig{})
		require.ErrorContains(t, err, "pass FromSQLDB or FromPgxPool, not a transaction", name)
	}

	_, err = tx.Middleware(tx.FromPgxPool(nil), tx.MiddlewareConfig{})
	require.ErrorContains(t, err, "tx.FromPgxPool was given a nil *pgxpool.Pool")

	// A pgoutbox Publisher bound to the pool (or a transaction) would
	// store a handler's messages even when its transaction rolls back.
	poolPub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.False(t, poolPub.FollowsContext())
	_, err = tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{Publisher: poolPub})
	require.ErrorContains(t, err, "build it with pgoutbox.NewContextPublisher")
	ctxPub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.True(t, ctxPub.FollowsContext())
	_, err = tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{Publisher: ctxPub})
	require.NoError(t, err)
	_, err = tx.Middleware(tx.FromSQLDB(nil), tx.MiddlewareConfig{})
	require.ErrorContains(t, err, "tx.FromSQLDB was given a nil *sql.DB")
	pub, err := pgoutbox.NewPublisher(tx.FromSQLTx(nil), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.ErrorContains(t, pub.Publish("t", newMsg("x")), "tx.FromSQLTx was given a nil *sql.Tx", "an error, not a panic")
}

// A handler that commits (or rolls back) tx.Middleware's transaction
// itself is told so, whichever pool the middleware runs on, and whether
// the message is the subscriber's (its completion fails) or not (the
// commit does): not that it should publish before Commit.
func TestTxMiddlewareSaysWhenTheHandlerEndedItsTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	end := func(ctx context.Context) error {
		if st, ok := tx.SQLTxFromContext(ctx); ok {
			return st.Commit()
		}
		pt, ok := tx.PgxTxFromContext(ctx)
		require.True(t, ok)
		return pt.Rollback(ctx)
	}
	for name, db := range map[string]tx.Executor{"pgxpool": tx.FromPgxPool(b.Pool), "database/sql": tx.FromSQLDB(b.sqlDB(t))} {
		t.Run(name+"/not the subscriber's", func(t *testing.T) {
			mw, err := tx.Middleware(db, tx.MiddlewareConfig{})
			require.NoError(t, err)
			_, err = mw(func(m *message.Message) ([]*message.Message, error) { return nil, end(m.Context()) })(newMsg("x"))
			require.ErrorIs(t, err, tx.ErrTxDone)
			require.ErrorContains(t, err, "the handler (or code it called) ended it")
			require.NotContains(t, err.Error(), "before Commit")
		})
		t.Run(name+"/the subscriber's", func(t *testing.T) {
			mw, err := tx.Middleware(db, tx.MiddlewareConfig{})
			require.NoError(t, err)
			m, _ := b.oneDelivered(t, "ended-"+strings.ReplaceAll(name, "/", "-"), nil)
			_, err = mw(func(m *message.Message) ([]*message.Message, error) { return nil, end(m.Context()) })(m)
			require.ErrorIs(t, err, tx.ErrTxDone)
			require.ErrorContains(t, err, "the handler (or code it called) ended it")
			require.NotContains(t, err.Error(), "before Commit")
			m.Nack()
		})
	}
}

// CQRS inside the handler's transaction: the buses are built once with a
// context publisher, and a command handler's domain write and the events
// it publishes commit together. A command whose transaction rolls back
// publishes nothing.
func TestCQRSCommandHandlerCommitsEventsWithItsWrite(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	h := newTxHandlerBed(t, b.Pool, b)
	ctx := context.Background()
	_, err := b.Pool.Exec(ctx, `CREATE TABLE `+b.Schema+`.bookings (room text PRIMARY KEY)`)
	require.NoError(t, err)
	type BookRoom struct{ Room string }
	type RoomBooked struct{ Room string }
	marshaler := cqrs.JSONMarshaler{}
	topic := func(name string) string { return "hotel." + name }

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(h.mw)
	commandBus, err := cqrs.NewCommandBusWithConfig(h.pub, cqrs.CommandBusConfig{
		GeneratePublishTopic: func(p cqrs.CommandBusGeneratePublishTopicParams) (string, error) { return topic(p.CommandName), nil },
		Marshaler:            marshaler,
	})
	require.NoError(t, err)
	eventBus, err := cqrs.NewEventBusWithConfig(h.pub, cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) { return topic(p.EventName), nil },
		Marshaler:            marshaler,
	})
	require.NoError(t, err)
	processor, err := cqrs.NewCommandProcessorWithConfig(r, cqrs.CommandProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
			return topic(p.CommandName), nil
		},
		SubscriberConstructor: func(cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			// Room 13 is retried while room 101 goes on (in order mode
			// it would hold back everything after it).
			return h.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) { c.MaxInFlight = 2 }), nil
		},
		Marshaler: marshaler,
	})
	require.NoError(t, err)
	handled := make(chan string, 10)
	require.NoError(t, processor.AddHandlers(cqrs.NewCommandHandler("book", func(ctx context.Context, c *BookRoom) error {
		defer func() {
			select {
			case handled <- c.Room:
			default: // the test has seen enough
			}
		}()
		pgTx, ok := tx.PgxTxFromContext(ctx)
		if !ok {
			return errors.New("no transaction in the command handler's context")
		}
		if _, err := pgTx.Exec(ctx, `INSERT INTO `+b.Schema+`.bookings VALUES ($1)`, c.Room); err != nil {
			return err
		}
		if err := eventBus.Publish(ctx, &RoomBooked{Room: c.Room}); err != nil {
			return err
		}
		if c.Room == "13" {
			return errors.New("room 13 does not exist") // after the event: it must vanish too
		}
		return nil
	})))
	startRouter(t, r)

	// Room 13 fails every time (retried until the test ends); room 101
	// commits.
	require.NoError(t, commandBus.Send(ctx, &BookRoom{Room: "13"}))
	require.NoError(t, commandBus.Send(ctx, &BookRoom{Room: "101"}))
	seen := map[string]int{}
	for seen["13"] < 3 || seen["101"] < 1 {
		select {
		case room := <-handled:
			seen[room]++
		case <-time.After(10 * time.Second):
			t.Fatalf("handled only %v", seen)
		}
	}
	pollUntil(t, "room 101's command completed", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic LIKE '%BookRoom'`) == 1
	})
	require.Equal(t, []string{"101"}, b.strings(t, `SELECT room FROM `+b.Schema+`.bookings`), "the failed command's writes rolled back")
	require.Equal(t, []string{`{"Room":"101"}`}, b.strings(t, `SELECT convert_from(payload, 'UTF8') FROM `+b.Schema+`.outbox WHERE topic LIKE '%RoomBooked'`),
		"only the committed command's event exists")
}

func (b *bundle) strings(t *testing.T, q string, args ...any) []string {
	t.Helper()
	return column[string](t, b, q, args...)
}

// A handler still running when its Router begins to close keeps a live
// message context through the drain, and commits: its write, its output
// and the row's completion; nothing is rolled back and redone. Both
// drivers: database/sql would roll back a transaction whose BeginTx
// context ended.
func TestTxMiddlewareCommitsFinishedWorkWhileTheRouterCloses(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "database/sql"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			h := newTxHandlerBed(t, b.Pool, b)
			db := tx.FromPgxPool(b.Pool)
			write := h.increment
			if driver == "database/sql" {
				sqlDB := b.sqlDB(t)
				db = tx.FromSQLDB(sqlDB)
				write = func(m *message.Message) error {
					sqlTx, ok := tx.SQLTxFromContext(m.Context())
					if !ok {
						return errors.New("no database/sql transaction in the handler's context")
					}
					_, err := sqlTx.ExecContext(m.Context(), `UPDATE `+b.Schema+`.counter SET n = n + 1 WHERE id = 1`)
					return err
				}
			}
			mw, err := tx.Middleware(db, tx.MiddlewareConfig{Publisher: h.pub})
			require.NoError(t, err)
			r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
			require.NoError(t, err)
			r.AddMiddleware(mw)
			started := make(chan struct{})
			cancelled := make(chan bool, 1)
			r.AddHandler("count", "in", h.newSubscriber(t, nil), "out", h.pub, func(m *message.Message) ([]*message.Message, error) {
				if err := write(m); err != nil {
					return nil, err
				}
				close(started)
				select {
				case <-m.Context().Done():
					cancelled <- true
				case <-time.After(300 * time.Millisecond): // the rest of its work, during the Close
					cancelled <- false
				}
				return []*message.Message{newMsg("output")}, nil
			})
			done := make(chan error, 1)
			go func() { done <- r.Run(context.Background()) }()
			<-r.Running()
			require.NoError(t, b.poolPublisher(t).Publish("in", newMsg("input")))
			<-started
			require.NoError(t, r.Close())
			require.NoError(t, <-done)
			require.False(t, <-cancelled, "closing the Router leaves the message context live during the drain")
			require.Equal(t, 1, h.counter(t), "the handler's write committed")
			require.Equal(t, 1, b.outboxRows(t, "out"), "its output committed")
			require.Equal(t, 0, b.outboxRows(t, "in"), "the message was completed")
		})
	}
}

// ErrLeaseLost is final for this delivery: Watermill's Retry outside
// tx.Middleware (the documented order) must not run the handler again, as
// each run could only roll back.
func TestTxMiddlewareLeaseLostIsNotRetried(t *testing.T) {
	t.Parallel()
	b := setup(t)
	h := newTxHandlerBed(t, b.Pool, b)
	ctx := context.Background()
	var calls atomic.Int32
	var stolen atomic.Bool
	outer := make(chan error, 1)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			p, err := next(m)
			if stolen.Load() {
				select {
				case outer <- err:
				default:
				}
			}
			return p, err
		}
	}, middleware.Retry{MaxRetries: 3, InitialInterval: 10 * time.Millisecond}.Middleware, h.mw)
	r.AddHandler("count", "in", h.newSubscriber(t, nil), "out", h.pub, func(m *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		if err := h.increment(m); err != nil {
			return nil, err
		}
		if stolen.CompareAndSwap(false, true) { // another consumer takes the row
			if _, err := b.Pool.Exec(ctx, `UPDATE `+b.Schema+`.outbox SET lease_token = gen_random_uuid(),
				leased_until = now() + interval '1 minute' WHERE topic = 'in'`); err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	startRouter(t, r)
	b.publishInTx(t, "in", true, newMsg("x"))
	select {
	case err := <-outer:
		require.ErrorIs(t, err, tx.ErrLeaseLost)
	case <-time.After(10 * time.Second):
		t.Fatal("the handler's result never came")
	}
	require.EqualValues(t, 1, calls.Load(), "the handler ran again after its lease was lost")
	require.Zero(t, h.counter(t), "the lost delivery's write rolled back")
}

// A middleware between Retry and tx.Middleware fails after the handler's
// transaction committed: Retry calls again, and the message, already
// done, is not processed again, nor reported as a lost lease: it counts as
// acked, once.
func TestTxMiddlewareRetryAfterCommitDoesNotRedo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	h := newTxHandlerBed(t, b.Pool, b)
	ev := newEvents()
	var calls, failed atomic.Int32
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(middleware.Retry{MaxRetries: 1, InitialInterval: 10 * time.Millisecond}.Middleware,
		func(next message.HandlerFunc) message.HandlerFunc {
			return func(m *message.Message) ([]*message.Message, error) {
				p, err := next(m)
				if err == nil && failed.Add(1) == 1 {
					return nil, errors.New("metrics sink down") // after the commit
				}
				return p, err
			}
		}, h.mw)
	r.AddHandler("count", "in", h.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Observer = ev }), "out", h.pub,
		func(m *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, h.increment(m)
		})
	startRouter(t, r)
	b.publishInTx(t, "in", true, newMsg("x"))
	ev.wait(t, pgoutbox.EventAcked, 10*time.Second)
	require.Equal(t, 0, b.outboxRows(t, "in"))
	require.Equal(t, 1, h.counter(t))
	require.EqualValues(t, 1, calls.Load(), "the committed handler ran again")
	require.Equal(t, 2, int(failed.Load()), "Retry called twice")
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost), "a processed message reported as a lost lease")
}

// Watermill's InstantAck acks a message before its handler runs, which
// ends the delivery: the row is deleted and the message's context ends
// (Watermill's contract: a context is cancelled after Ack). tx.Middleware
// behind it refuses the message with an error that names the cause, on
// every claim path and MaxInFlight, rather than race the subscriber's
// delete of the row and report a lost lease.
func TestTxMiddlewareRefusesAMessageAckedBeforeIt(t *testing.T) {
	for _, inFlight := range []int{1, 4} {
		t.Run(fmt.Sprintf("in-flight=%d", inFlight), func(t *testing.T) {
			t.Parallel()
			onEachClaimPath(t, func(t *testing.T, path string) {
				base := setup(t)
				b := newTxHandlerBed(t, base.Pool, base)
				b.publishInTx(t, "tx", true, newMsgs(3)...)
				sub := b.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) {
					onPath(t, path, c)
					c.MaxInFlight = inFlight
				})
				r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
				require.NoError(t, err)
				refused := make(chan error, 16)
				r.AddConsumerHandler("tx", "tx", sub, func(m *message.Message) error {
					refused <- errors.New("the handler ran")
					return nil
				}).AddMiddleware(middleware.InstantAck, func(h message.HandlerFunc) message.HandlerFunc {
					return func(m *message.Message) ([]*message.Message, error) {
						out, err := b.mw(h)(m)
						if err != nil {
							refused <- err
						}
						return out, err
					}
				})
				go func() { _ = r.Run(context.Background()) }()
				<-r.Running()
				t.Cleanup(func() { _ = r.Close() })

				for range 3 {
					select {
					case err := <-refused:
						require.ErrorContains(t, err, "already acked (middleware.InstantAck")
					case <-time.After(20 * time.Second):
						t.Fatal("tx.Middleware did not answer")
					}
				}
				pollUntil(t, "outbox empty", 20*time.Second, nil, func() bool { return b.outboxRows(t, "tx") == 0 })
				require.NoError(t, r.Close()) // every handler has returned
				require.Zero(t, b.counter(t), "no handler's work ran")
			})
		})
	}
}

// An Ack inside the handler's transaction (the handler's own, or
// middleware.InstantAck inside tx.Middleware) waits for that transaction:
// the write, the output and the completion commit together. The
// subscriber deleted the row at the Ack, the completion found none and
// rolled the work back, and the message was gone. A Nack with no error
// rolls back and the message comes again.
func TestTxMiddlewareAnAckInsideTheHandlerCommitsWithIt(t *testing.T) {
	t.Parallel()
	for _, instantAck := range []bool{false, true} {
		t.Run(fmt.Sprintf("InstantAck=%v", instantAck), func(t *testing.T) {
			t.Parallel()
			onEachClaimPath(t, func(t *testing.T, path string) {
				base := setup(t)
				b := newTxHandlerBed(t, base.Pool, base)
				const n = 10
				msgs := newMsgs(n)
				if !instantAck {
					msgs[0].Metadata.Set("nack", "once")
				}
				b.publishInTx(t, "tx", true, msgs...)
				sub := b.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) {
					onPath(t, path, c)
					c.MaxInFlight = 4
				})
				r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
				require.NoError(t, err)
				r.AddMiddleware(b.mw)
				if instantAck {
					r.AddMiddleware(middleware.InstantAck) // inside tx.Middleware
				}
				var nacked atomic.Bool
				r.AddHandler("tx", "tx", sub, "out", b.pub, func(m *message.Message) ([]*message.Message, error) {
					if err := b.increment(m); err != nil {
						return nil, err
					}
					if m.Metadata.Get("nack") != "" && nacked.CompareAndSwap(false, true) {
						m.Nack()
						return nil, nil
					}
					m.Ack()
					time.Sleep(20 * time.Millisecond) // the subscriber would take the Ack meanwhile
					return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("out"))}, nil
				})
				startRouter(t, r)
				pollUntil(t, "every message handled", 20*time.Second, nil, func() bool { return base.outboxRows(t, "tx") == 0 })
				require.NoError(t, r.Close())
				require.Equal(t, n, b.counter(t), "every handler's write committed once (a nacked one's rolled back)")
				require.Equal(t, n, base.outboxRows(t, "out"), "every output committed once")
				require.Equal(t, !instantAck, nacked.Load())
			})
		})
	}
}

// A CQRS command handler has the message's context, not the message:
// RejectContext dead-letters its command at once (reason "rejected", one
// delivery), with tx.Middleware around it or not.
func TestCQRSCommandHandlerRejectsWithItsContext(t *testing.T) {
	t.Parallel()
	for _, inTx := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "tx.Middleware"}[inTx], func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			h := newTxHandlerBed(t, b.Pool, b)
			type BookRoom struct{ Room string }
			marshaler := cqrs.JSONMarshaler{}
			r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
			require.NoError(t, err)
			r.AddMiddleware(pgoutbox.ErrorRecorder)
			if inTx {
				r.AddMiddleware(h.mw)
			}
			commandBus, err := cqrs.NewCommandBusWithConfig(h.pub, cqrs.CommandBusConfig{
				GeneratePublishTopic: func(p cqrs.CommandBusGeneratePublishTopicParams) (string, error) { return p.CommandName, nil },
				Marshaler:            marshaler,
			})
			require.NoError(t, err)
			processor, err := cqrs.NewCommandProcessorWithConfig(r, cqrs.CommandProcessorConfig{
				GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) { return p.CommandName, nil },
				SubscriberConstructor: func(cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
					return h.newSubscriber(t, nil), nil
				},
				Marshaler: marshaler,
			})
			require.NoError(t, err)
			var calls atomic.Int32
			require.NoError(t, processor.AddHandlers(cqrs.NewCommandHandler("book", func(ctx context.Context, c *BookRoom) error {
				calls.Add(1)
				return pgoutbox.RejectContext(ctx, "room "+c.Room+" does not exist")
			})))
			startRouter(t, r)
			require.NoError(t, commandBus.Send(context.Background(), &BookRoom{Room: "13"}))
			pollUntil(t, "the command dead-lettered", 10*time.Second, nil, func() bool {
				return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`) == 1
			})
			require.Equal(t, []string{"rejected 1"}, b.strings(t, `SELECT failure_reason || ' ' || deliveries FROM `+b.Schema+`.outbox_dlq`))
			require.Contains(t, b.strings(t, `SELECT last_error FROM `+b.Schema+`.outbox_dlq`)[0], "room 13 does not exist")
			require.EqualValues(t, 1, calls.Load())
		})
	}
}

// recordingPublisher records the value of ctxKey in each published
// message's context, then publishes through next.
type recordingPublisher struct {
	next message.Publisher
	mu   sync.Mutex
	seen []any
}

type ctxKey struct{}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	for _, m := range msgs {
		p.seen = append(p.seen, m.Context().Value(ctxKey{}))
	}
	p.mu.Unlock()
	return p.next.Publish(topic, msgs...)
}
func (p *recordingPublisher) Close() error { return nil }

// The messages a handler returns are published in its transaction with
// their own contexts' values (a span, say), the first one's too, and
// commit with it.
func TestTxMiddlewarePublishesOutputsWithTheirOwnContextValues(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	rec := &recordingPublisher{next: pub}
	mw, err := tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{Publisher: rec})
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(mw)
	r.AddHandler("outputs", "in", b.subscriber(t, nil), "out", rec, func(m *message.Message) ([]*message.Message, error) {
		var out []*message.Message
		for _, v := range []string{"first", "second"} {
			o := newMsg(v)
			o.SetContext(context.WithValue(m.Context(), ctxKey{}, v))
			out = append(out, o)
		}
		return out, nil
	})
	startRouter(t, r)
	b.publishInTx(t, "in", true, newMsg("in"))
	pollUntil(t, "the outputs committed", 10*time.Second, nil, func() bool { return b.outboxRows(t, "out") == 2 })
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Equal(t, []any{"first", "second"}, rec.seen)
}

// A context publisher publishes one call in one transaction: messages
// whose contexts carry different ones (or one and none) are refused, and
// nothing is published, where the statement would have committed them all
// with the first message's transaction.
func TestContextPublisherRefusesMessagesOfDifferentTransactions(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	begin := func() pgx.Tx {
		t.Helper()
		x, err := b.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = x.Rollback(ctx) })
		return x
	}
	in := func(x pgx.Tx, payload string) *message.Message {
		m := newMsg(payload)
		if x != nil {
			m.SetContext(tx.WithExecutor(ctx, tx.FromPgxTx(x)))
		}
		return m
	}
	a, c := begin(), begin()
	err = pub.Publish("mixed", in(a, "a"), in(c, "c"))
	require.ErrorContains(t, err, "messages 0 and 1 of one Publish carry different transactions")
	err = pub.Publish("mixed", in(a, "a"), in(nil, "none"))
	require.ErrorContains(t, err, "different transactions")
	_, err = pub.PublishWithResult("mixed", in(nil, "none"), in(c, "c"))
	require.ErrorContains(t, err, "different transactions")

	require.NoError(t, pub.Publish("mixed", in(a, "a1"), in(a, "a2")), "one transaction")
	require.NoError(t, a.Commit(ctx))
	require.NoError(t, c.Commit(ctx))
	require.Equal(t, 2, b.outboxRows(t, "mixed"), "only the call of one transaction published")
}

// On a database whose transactions default to REPEATABLE READ
// (default_transaction_isolation, here set on the consumer's connections),
// every message is handled once, never failing with a lost lease, on
// every claim path: the handler's transaction takes its snapshot after a
// held row became a lease (before, its DELETE could not see the lease and
// reported it lost), and the held transactions run READ COMMITTED as the
// claims need.
func TestTxMiddlewareOnARepeatableReadDatabase(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx := context.Background()
		pool := b.poolWith(t, map[string]string{"default_transaction_isolation": "repeatable read"}, nil)
		_, err := b.Pool.Exec(ctx, `CREATE TABLE `+b.Schema+`.seen (uuid text PRIMARY KEY)`)
		require.NoError(t, err)
		h := newTxHandlerBed(t, pool, b)
		sub := h.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.MaxInFlight = 4
			onPath(t, path, c)
		})
		var mu sync.Mutex
		var failures []error
		levels := map[string]int{}
		r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		require.NoError(t, err)
		r.AddConsumerHandler("seen", "in", sub, func(m *message.Message) error {
			pgTx, _ := tx.PgxTxFromContext(m.Context())
			var level string
			if err := pgTx.QueryRow(m.Context(), `SHOW transaction_isolation`).Scan(&level); err != nil {
				return err
			}
			mu.Lock()
			levels[level]++
			mu.Unlock()
			_, err := pgTx.Exec(m.Context(), `INSERT INTO `+b.Schema+`.seen VALUES ($1)`, m.UUID)
			return err
		}).AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
			return func(m *message.Message) ([]*message.Message, error) {
				out, err := next(m)
				if err != nil {
					mu.Lock()
					failures = append(failures, err)
					mu.Unlock()
				}
				return out, err
			}
		}, h.mw)
		startRouter(t, r)
		const n = 100
		require.NoError(t, b.poolPublisher(t).Publish("in", newMsgs(n)...))
		pollUntil(t, "all handled", 30*time.Second, nil, func() bool {
			return b.count(t, `SELECT count(*) FROM `+b.Schema+`.seen`) == n && b.outboxRows(t, "in") == 0
		})
		mu.Lock()
		defer mu.Unlock()
		// The handler's transaction has the pool's default, as the guide
		// says; pgoutbox's own transactions run READ COMMITTED.
		require.Equal(t, []string{"repeatable read"}, slices.Collect(maps.Keys(levels)))
		// A change the subscriber made to a row while its handler ran (a
		// new liveness stamp: at start, or when the lock could not be
		// confirmed in time on a loaded machine) fails that transaction
		// with a serialization error, and it runs again; never as a lost
		// lease.
		for _, err := range failures {
			require.NotErrorIs(t, err, tx.ErrLeaseLost)
			require.ErrorContains(t, err, "SQLSTATE 40001")
		}
	})
}

// tx.Middleware given a pool of another database that has the outbox's
// tables too (the application's other database) said only that every
// message's lease was lost; it names both databases.
func TestTxMiddlewareOnAnotherDatabaseSaysSo(t *testing.T) {
	t.Parallel()
	ours, other := setupHealth(t), setupHealth(t)
	sub, err := pgoutbox.NewSubscriber(ours.pool, pgoutbox.SubscriberConfig{Tables: ours.tables, RetryPolicy: pgoutbox.ConstantBackoff{MaxAttempts: 1}}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(ours.pool), pgoutbox.PublisherConfig{Tables: ours.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("in", newMsg("x")))

	mw, err := tx.Middleware(tx.FromPgxPool(other.pool), tx.MiddlewareConfig{})
	require.NoError(t, err)
	got := make(chan error, 1)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			produced, err := next(m)
			select {
			case got <- err:
			default:
			}
			return produced, err
		}
	}, mw)
	r.AddConsumerHandler("h", "in", sub, func(*message.Message) error { return nil })
	startRouter(t, r)
	select {
	case err := <-got:
		require.ErrorContains(t, err, `runs in database "`+other.db+`", but the subscriber's messages are in database "`+ours.db+`"`)
	case <-time.After(15 * time.Second):
		t.Fatal("the handler did not run")
	}
}

// A timer that re-arms itself: the handler returns the next occurrence
// with the incoming message's own dedup key. The key is free once the
// message's row is gone, and in tx.Middleware that is the handler's
// transaction's completion, so the returned message is written after it.
// It was written before, met the incoming row's key and was skipped: the
// timer ran once and stopped, Publish reporting nothing.
func TestTxMiddlewareReturnedMessageMayReuseTheIncomingDedupKey(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		h := newTxHandlerBed(t, b.Pool, b)
		r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		require.NoError(t, err)
		r.AddMiddleware(h.mw)
		r.AddHandler("tick", "tick", h.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c) }), "tick", h.pub,
			func(m *message.Message) ([]*message.Message, error) {
				// The run's number as its transaction sees it: an attempt
				// that rolls back and runs again counts once.
				pgTx, _ := tx.PgxTxFromContext(m.Context())
				var run int
				if err := pgTx.QueryRow(m.Context(), `UPDATE `+b.Schema+`.counter SET n = n + 1 WHERE id = 1 RETURNING n`).Scan(&run); err != nil {
					return nil, err
				}
				if run >= 3 {
					return nil, nil
				}
				next := newMsg("tick")
				pgoutbox.WithDedupKey(next, "the-timer")
				pgoutbox.DeliverAfter(next, 50*time.Millisecond)
				return []*message.Message{next}, nil
			})
		startRouter(t, r)
		first := newMsg("tick")
		pgoutbox.WithDedupKey(first, "the-timer")
		require.NoError(t, b.poolPublisher(t).Publish("tick", first))
		pollUntil(t, "three runs of the timer", 30*time.Second, nil, func() bool {
			return h.counter(t) == 3 && b.outboxRows(t, "tick") == 0
		})
	})
}

// A handler that ends tx.Middleware's transaction with a COMMIT or
// ROLLBACK statement through the executor (shared code written for
// autocommit, a ported script): the driver saw nothing of it, and the
// completion ran on its own, deleting the row at once, while the
// handler's writes were gone (ROLLBACK) or committed apart (COMMIT). The
// middleware now says so on a pgx pool, and the message stays to be
// delivered again (database/sql tells nothing of it: documented).
func TestTxMiddlewareSaysWhenTheHandlerEndedItsTransactionBySQL(t *testing.T) {
	t.Parallel()
	b := setup(t)
	onEachClaimPath(t, func(t *testing.T, path string) {
		for _, stmt := range []string{"ROLLBACK", "COMMIT"} {
			mw, err := tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{})
			require.NoError(t, err)
			topic := "ended-by-sql-" + path + "-" + stmt
			m, msgs := b.oneDelivered(t, topic, func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c) })
			_, err = mw(func(m *message.Message) ([]*message.Message, error) {
				e, ok := tx.ExecutorFromContext(m.Context())
				require.True(t, ok)
				_, err := e.Exec(m.Context(), stmt)
				return nil, err
			})(m)
			m.Nack()
			require.ErrorContains(t, err, "the handler (or code it called) ended it")
			require.ErrorContains(t, err, "COMMIT or ROLLBACK statement")
			require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = $1`, topic), "the message stays")
			again := receive(t, msgs, 10*time.Second)
			require.Equal(t, m.UUID, again.UUID, "delivered again")
			again.Ack()
		}
	})
}

// A handler that ended the transaction through the driver gave its
// connection back to the pool; the check for a COMMIT or ROLLBACK
// statement then read that connection while another goroutine used it (a
// data race under -race) and named a statement that was never run. The
// check stays off once the driver ended the transaction.
func TestTxMiddlewareLeavesTheConnectionOnceTheDriverEndedTheTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool := b.poolWith(t, nil, func(c *pgxpool.Config) { c.MaxConns = 1 })
	mw, err := tx.Middleware(tx.FromPgxPool(pool), tx.MiddlewareConfig{})
	require.NoError(t, err)
	for range 20 {
		done := make(chan struct{})
		_, err = mw(func(m *message.Message) ([]*message.Message, error) {
			pt, ok := tx.PgxTxFromContext(m.Context())
			require.True(t, ok)
			if err := pt.Rollback(m.Context()); err != nil {
				return nil, err
			}
			go func() {
				defer close(done)
				_, _ = pool.Exec(context.Background(), "SELECT 1")
			}()
			return nil, nil
		})(newMsg("x"))
		<-done
		require.ErrorContains(t, err, "the handler (or code it called) ended it")
		require.NotContains(t, err.Error(), "COMMIT or ROLLBACK statement")
	}
}

// oneDelivered publishes a message to topic and returns it as a
// subscriber of b (mod changes its config when not nil) delivers it, with
// the subscription's channel.
func (b *bundle) oneDelivered(t *testing.T, topic string, mod func(*pgoutbox.SubscriberConfig)) (*message.Message, <-chan *message.Message) {
	t.Helper()
	b.publishInTx(t, topic, true, newMsg("x"))
	msgs, err := b.subscriber(t, mod).Subscribe(context.Background(), topic)
	require.NoError(t, err)
	return receive(t, msgs, 10*time.Second), msgs
}

// A handler's COMMIT whose answer is lost may have committed: the handler
// stack got "commit the handler's transaction: conn closed", as a failed
// commit that rolled back, and the subscriber's nack, finding the row the
// transaction completed gone, warned of a lost lease. The error is now
// tx.ErrOutcomeUnknown, and the nack that finds the row gone says the
// message is done. On every claim path.
func TestTxMiddlewareCommitWhoseAnswerIsLost(t *testing.T) {
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx := context.Background()
		_, err := b.Pool.Exec(ctx, `CREATE TABLE `+b.Schema+`.effects (uuid text PRIMARY KEY)`)
		require.NoError(t, err)
		px := startAnswerTrapProxy(t, b.DSN, "commit")
		handlerPool := px.pool(t, b, "answer-lost-"+path)
		logs := &logCapture{}
		cfg := pgoutbox.SubscriberConfig{Tables: b.tables}
		onPath(t, path, &cfg)
		sub, err := pgoutbox.NewSubscriber(b.Pool, cfg, logs)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		mw, err := tx.Middleware(tx.FromPgxPool(handlerPool), tx.MiddlewareConfig{CommitTimeout: 500 * time.Millisecond})
		require.NoError(t, err)
		inTx := mw(func(msg *message.Message) ([]*message.Message, error) {
			exec, ok := tx.ExecutorFromContext(msg.Context())
			require.True(t, ok)
			if _, err := exec.Exec(msg.Context(), `INSERT INTO `+b.Schema+`.effects VALUES ($1)`, msg.UUID); err != nil {
				return nil, err
			}
			px.armed.Store(true) // the COMMIT that follows commits; its answer is lost
			return nil, nil
		})
		errs := make(chan error, 10)
		runRouter(t, sub, "t", func(msg *message.Message) error {
			_, err := inTx(msg)
			errs <- err
			return err
		})
		require.NoError(t, b.poolPublisher(t).Publish("t", newMsg("once")))
		select {
		case err := <-errs:
			require.ErrorIs(t, err, tx.ErrOutcomeUnknown)
			require.ErrorIs(t, err, tx.ErrCommitUnanswered)
			require.True(t, pgoutbox.Redelivered(err), "a PoisonQueue filter leaves it alone")
		case <-time.After(30 * time.Second):
			t.Fatal("the handler did not return")
		}
		require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.effects`), "the transaction committed")
		pollUntil(t, "the nack's finding logged", 30*time.Second, nil, func() bool {
			return len(logs.find("info", func(e logEntry) bool { return strings.Contains(e.msg, "committed after all") })) > 0
		})
		require.Empty(t, logs.find("info", func(e logEntry) bool { return strings.HasPrefix(e.msg, "Lease lost") }), "no lease was lost")
		require.Zero(t, b.outboxRows(t, "t"))
		select {
		case err := <-errs:
			t.Fatalf("handled again: %v", err)
		default:
		}
	})
}
