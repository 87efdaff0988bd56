package tests

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Router.Close cancels the context it gave Subscribe. Handlers in flight
// keep a live message context through the drain, finish, and their acks
// are written before the Router's Close returns; the messages no handler
// had are given back.
func TestRouterCloseLetsInFlightHandlersFinish(t *testing.T) {
	t.Parallel()
	for _, inFlight := range []int{1, 4} {
		t.Run("max_in_flight="+map[int]string{1: "1", 4: "4"}[inFlight], func(t *testing.T) {
			t.Parallel()
			onEachClaimPath(t, func(t *testing.T, path string) {
				b := setup(t)
				require.NoError(t, b.poolPublisher(t).Publish("t", newMsgs(8)...))
				sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
					onPath(t, path, c)
					c.MaxInFlight = inFlight
					c.DrainTimeout = 20 * time.Second
				})
				started := make(chan struct{}, 8)
				release := make(chan struct{})
				var finished, cancelled atomic.Int32
				r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, watermill.NopLogger{})
				require.NoError(t, err)
				spy := &subscribeSpy{Subscriber: sub, ctx: make(chan context.Context, 1)}
				r.AddConsumerHandler("h", "t", spy, func(m *message.Message) error {
					started <- struct{}{}
					select {
					case <-release:
						finished.Add(1)
						return nil
					case <-m.Context().Done():
						cancelled.Add(1)
						return m.Context().Err()
					}
				})
				done := make(chan error, 1)
				go func() { done <- r.Run(context.Background()) }()
				<-r.Running()
				for range inFlight {
					<-started
				}
				closed := make(chan error, 1)
				go func() { closed <- r.Close() }()
				subCtx := <-spy.ctx
				select {
				case <-subCtx.Done(): // the Router is closing; the handlers still run
				case <-time.After(10 * time.Second):
					t.Fatal("the Router did not cancel the Subscribe context")
				}
				close(release)
				require.NoError(t, <-closed)
				require.NoError(t, <-done)
				require.Zero(t, cancelled.Load(), "no handler saw its context cancelled")
				require.Equal(t, int32(inFlight), finished.Load())
				require.Equal(t, 8-inFlight, b.outboxRows(t, "t"), "the finished messages were acked, the rest given back")
			})
		})
	}
}

// subscribeSpy hands over the context a Router subscribes with.
type subscribeSpy struct {
	message.Subscriber
	ctx chan context.Context
}

func (s *subscribeSpy) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.ctx <- ctx
	return s.Subscriber.Subscribe(ctx, topic)
}

// A tx.Middleware handler that returned before the drain's end, and whose
// transaction is still finishing when it ends (here: its output waits for
// a dedup key another transaction holds), commits: the drain leaves its
// row to that transaction instead of giving it back under it, which made
// the completion find no lease and roll the finished work back.
func TestDrainLetsAFinishingTransactionCommit(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx := context.Background()
		b.exec(t, `CREATE TABLE %s.done (id text PRIMARY KEY)`)
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.DrainTimeout = 200 * time.Millisecond
		})
		pub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
		require.NoError(t, err)
		txMiddleware, err := tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{Publisher: pub})
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, b.logger)
		require.NoError(t, err)
		router.AddMiddleware(txMiddleware)
		msgCtx := make(chan context.Context, 1)
		router.AddHandler("confirm", "orders", sub, "confirmed", pub, func(msg *message.Message) ([]*message.Message, error) {
			select {
			case msgCtx <- msg.Context():
			default:
			}
			pgTx, _ := tx.PgxTxFromContext(msg.Context())
			if _, err := pgTx.Exec(msg.Context(), `INSERT INTO `+b.Schema+`.done VALUES ($1)`, string(msg.Payload)); err != nil {
				return nil, err
			}
			return confirmation(msg), nil
		})
		holder, routerErr := runWithOutputHeld(t, b, router)

		closed := make(chan error, 1)
		go func() { closed <- router.Close() }()
		// The drain ends (200 ms) while the transaction still waits: it
		// ends the message's context.
		select {
		case <-(<-msgCtx).Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the drain did not end the message's context")
		}
		// Checked here, not in require.Never: Never returns at its deadline
		// with a check possibly still running on a goroutine of its own, and
		// on a busy machine that check's query ran after the rollback below,
		// when the committed transaction had deleted the row (no rows).
		for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
			var released bool
			require.NoError(t, b.Pool.QueryRow(ctx, `SELECT lease_token IS NULL FROM `+b.Schema+`.outbox WHERE topic = 'orders'`).Scan(&released))
			require.False(t, released, "the drain gave the row back under the transaction finishing it")
		}
		require.NoError(t, holder.Rollback(ctx))
		require.NoError(t, <-closed)
		require.NoError(t, <-routerErr)

		var done int
		require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(*) FROM `+b.Schema+`.done`).Scan(&done))
		require.Equal(t, 1, done, "the handler's write committed")
		b.RequireNotPublished(t, b.Exec(), "orders")
		b.RequirePublished(t, b.Exec(), "confirmed")
	})
}

// The same with the README's Retry outside tx.Middleware, and a transaction
// that rolls back after the drain's end (its output's insert runs out of
// CommitTimeout): the drain ends the message's context, so Retry runs no
// further attempt, and once the transaction ended the row goes back. Close
// returns; the message waits for the next consumer.
func TestDrainEndsAFinishingTransactionsRetries(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx := context.Background()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.DrainTimeout = 200 * time.Millisecond
			c.AckDeadline = pgoutbox.NoAckDeadline
			c.MaxInFlight = 4 // the slots' messages; the test above has the owner's (MaxInFlight 1)
		})
		pub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
		require.NoError(t, err)
		// CommitTimeout well after DrainTimeout: the first attempt's
		// transaction ends after the drain ended the message, also on a
		// busy machine (500 ms, with a full suite and more beside it, let
		// the attempt fail first, and Retry ran a second).
		txMiddleware, err := tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{Publisher: pub, CommitTimeout: 2 * time.Second})
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, b.logger)
		require.NoError(t, err)
		router.AddMiddleware(middleware.Retry{MaxRetries: 3, InitialInterval: 10 * time.Millisecond}.Middleware, txMiddleware)
		var runs atomic.Int32
		router.AddHandler("confirm", "orders", sub, "confirmed", pub, func(msg *message.Message) ([]*message.Message, error) {
			if runs.Add(1) > 1 {
				<-msg.Context().Done() // a later attempt waits for its message's end
				return nil, msg.Context().Err()
			}
			return confirmation(msg), nil
		})
		holder, routerErr := runWithOutputHeld(t, b, router)

		closed := make(chan error, 1)
		go func() { closed <- router.Close() }()
		select {
		case err := <-closed:
			require.NoError(t, err)
		case <-time.After(20 * time.Second):
			t.Fatalf("Close did not return: the drain waits for attempts that never end (runs: %d)", runs.Load())
		}
		require.NoError(t, <-routerErr)
		require.EqualValues(t, 1, runs.Load(), "no attempt after the drain ended the message")
		b.RequirePublished(t, b.Exec(), "orders") // given back, for the next consumer
		require.NoError(t, holder.Rollback(ctx))
	})
}

// confirmation is the "confirm" handler's output for msg, with the dedup
// key runWithOutputHeld holds for "order-1".
func confirmation(msg *message.Message) []*message.Message {
	out := message.NewMessage(watermill.NewUUID(), msg.Payload)
	pgoutbox.WithDedupKey(out, "confirm-"+string(msg.Payload))
	return []*message.Message{out}
}

// runWithOutputHeld runs router, whose "confirm" handler returns
// confirmation(msg), publishes "order-1" to "orders", and returns once
// the handler returned and its output's insert waits for holder, a
// transaction that holds that dedup key (begun after Subscribe: a first
// binding waits for the transactions writing to the outbox). The caller
// ends holder.
func runWithOutputHeld(t *testing.T, b *bundle, router *message.Router) (holder pgx.Tx, routerErr <-chan error) {
	t.Helper()
	ctx := context.Background()
	errs := make(chan error, 1)
	go func() { errs <- router.Run(ctx) }()
	<-router.Running()
	holder, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
	_, err = holder.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, dedup_key) VALUES ('confirmed', 'x', '\x00', 'confirm-order-1')`)
	require.NoError(t, err)
	require.NoError(t, b.poolPublisher(t).Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("order-1"))))
	require.Eventually(t, func() bool {
		var waiting bool
		require.NoError(t, b.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO%' AND position($1 in query) > 0 AND pid <> pg_backend_pid())`,
			`"`+b.Schema+`"."outbox"`).Scan(&waiting))
		return waiting
	}, 10*time.Second, 10*time.Millisecond, "the handler returned and its output waits for the dedup key")
	return holder, errs
}
