package tests

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Close waits for an in-flight message's verdict (within DrainTimeout) and
// writes it before returning.
func TestCloseWaitsForInFlightAck(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.DrainTimeout = time.Minute })
	b.publishInTx(t, "t", true, newMsg("x"))
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)

	closed := make(chan error, 1)
	go func() { closed <- sub.Close() }()
	select {
	case <-closed:
		t.Fatal("Close returned while a message was in flight and the drain time not over")
	case <-time.After(300 * time.Millisecond):
	}
	m.Ack()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the ack")
	}
	require.Equal(t, 0, b.outboxRows(t, "t"), "the ack must be written before Close returns")
	_, ok := <-ch
	require.False(t, ok, "the output channel must be closed")
}

// Ending one subscription's context ends that subscription only.
func TestCancelEndsOneSubscriptionOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.subscriber(t, nil)
	ctxA, cancelA := context.WithCancel(context.Background())
	chA, err := sub.Subscribe(ctxA, "a")
	require.NoError(t, err)
	chB, err := sub.Subscribe(context.Background(), "b")
	require.NoError(t, err)

	cancelA()
	select {
	case _, ok := <-chA:
		require.False(t, ok)
	case <-time.After(10 * time.Second):
		t.Fatal("cancelled subscription's channel not closed")
	}
	b.publishInTx(t, "b", true, newMsg("still here"))
	m := receive(t, chB, 10*time.Second)
	require.Equal(t, "still here", string(m.Payload))
	m.Ack()

	// And the Subscriber takes new subscriptions.
	chA2, err := sub.Subscribe(context.Background(), "a")
	require.NoError(t, err)
	b.publishInTx(t, "a", true, newMsg("again"))
	receive(t, chA2, 10*time.Second).Ack()
}

// MaxInFlight bounds what a subscription holds: handed-out messages and
// leased rows alike.
func TestMaxInFlightBoundsLeasedRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	msgs := newMsgs(10)
	b.publishInTx(t, "t", true, msgs...)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.MaxInFlight = 3 })
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)

	var got []*message.Message
	for range 3 {
		got = append(got, receive(t, ch, 10*time.Second))
	}
	requireNothing(t, ch, 300*time.Millisecond)
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE lease_token IS NOT NULL`))

	got[0].Ack()
	got = append(got, receive(t, ch, 10*time.Second))
	for _, m := range got[1:] {
		m.Ack()
	}
	for range 6 {
		receive(t, ch, 10*time.Second).Ack()
	}
}

// With MaxInFlight 1 the next message waits for the previous verdict and
// messages arrive in publish order, across Publish calls.
func TestSingleInFlightKeepsPublishOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for i := range 20 {
		b.publishInTx(t, "t", true, newMsg(fmt.Sprint(2*i)), newMsg(fmt.Sprint(2*i+1)))
	}
	sub := b.subscriber(t, nil)
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	for i := range 40 {
		m := receive(t, ch, 10*time.Second)
		require.Equal(t, fmt.Sprint(i), string(m.Payload))
		m.Ack()
	}
}

// TestClosedPoolEndsTheSubscription: a Subscriber whose pool is closed
// under it (a test closing its pool first, a service shutting down in the
// wrong order) ends each subscription with one ERROR saying so, instead of
// retrying for ever, and deletes nothing: the message it held is delivered
// again to a subscriber on a live pool.
func TestClosedPoolEndsTheSubscription(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logs := &logCapture{}
	pool, err := pgxpool.New(context.Background(), b.DSN)
	require.NoError(t, err)
	b.logger = logs
	sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.Lease = 2 * time.Second
		c.DrainTimeout = -1
	})
	msgs, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	held := newMsg("held")
	b.publishInTx(t, "t", true, held)
	require.Equal(t, held.UUID, receive(t, msgs, 10*time.Second).UUID) // never acked

	pool.Close()
	select {
	case _, ok := <-msgs:
		for ok { // drain whatever was prefetched
			_, ok = <-msgs
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the subscription did not end after its pool was closed")
	}
	isClosedPool := func(e logEntry) bool {
		return e.err != nil && strings.Contains(e.err.Error(), "closed pool")
	}
	errs := logs.find("error", isClosedPool)
	require.Len(t, errs, 1, "one ERROR for a closed pool: %v", errs)
	require.Contains(t, errs[0].msg, "its pool was closed")

	// Nothing was deleted: the row comes back once its lease expires.
	b.logger = watermill.NopLogger{}
	other := b.subscriber(t, nil)
	again, err := other.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := receive(t, again, 15*time.Second)
	require.Equal(t, held.UUID, m.UUID)
	m.Ack()
}

// Subscribe and Publish on a pool closed before them say so, with what to
// do, rather than pgxpool's bare "closed pool".
func TestSubscribeAndPublishOnAClosedPoolSaySo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, err := pgxpool.New(context.Background(), b.DSN)
	require.NoError(t, err)
	sub := b.subscriberOn(t, pool, nil)
	pool.Close()
	_, err = sub.Subscribe(context.Background(), "t")
	require.Error(t, err)
	require.Contains(t, err.Error(), `pgoutbox: Subscribe to "t": `)
	require.Contains(t, err.Error(), "the pgxpool.Pool given to pgoutbox was closed: close the Subscribers and Publishers of a pool")

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	err = pub.Publish("t", newMsg("a"))
	require.Error(t, err)
	require.Contains(t, err.Error(), `pgoutbox: publish to "t"`)
	require.Contains(t, err.Error(), "the pgxpool.Pool given to pgoutbox was closed")
}

// Close ends a Subscribe that waits for an unreachable database (a server
// that accepts connections and never answers): a Router closing while it
// starts must not wait out its CloseTimeout.
func TestCloseEndsASubscribeWaitingForTheDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Close() }) // held open, never answered
		}
	}()
	cfg, err := pgxpool.ParseConfig("postgres://postgres@" + l.Addr().String() + "/postgres?pool_max_conns=2")
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, Lease: 5 * time.Minute, StatementTimeout: time.Minute}, nil)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := sub.Subscribe(context.Background(), "t")
		done <- err
	}()
	pollUntil(t, "Subscribe connecting", 10*time.Second, nil, func() bool { return pool.Stat().TotalConns() > 0 })
	requireClosed(t, "Close", sub.Close)
	select {
	case err := <-done:
		require.ErrorIs(t, err, pgoutbox.ErrSubscriberClosed)
	case <-time.After(10 * time.Second):
		t.Fatal("Subscribe still waits after Close")
	}
}

// A Router stopped by cancelling Run's context does not close its
// subscribers (Watermill closes them in Router.Close only): a Subscriber
// with an Observer kept its event goroutine for good, one more for every
// such Router. Not parallel: it counts the process's goroutines, and no
// parallel test runs beside a sequential one.
func TestARouterStoppedByItsContextLeavesNoObserverGoroutine(t *testing.T) {
	b := setup(t)
	queues := func() int {
		var buf bytes.Buffer
		require.NoError(t, pprof.Lookup("goroutine").WriteTo(&buf, 2))
		return strings.Count(buf.String(), "pgoutbox.(*eventQueue).run(")
	}
	before := queues()
	for i := range 5 {
		topic := fmt.Sprintf("router-by-context-%d", i)
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.Observer = pgoutbox.ObserverFunc(func(pgoutbox.Event) {})
		})
		r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		require.NoError(t, err)
		handled := make(chan struct{}, 1)
		r.AddConsumerHandler(topic, topic, sub, func(*message.Message) error {
			handled <- struct{}{}
			return nil
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		require.NoError(t, b.poolPublisher(t).Publish(topic, newMsgs(1)...))
		select {
		case <-handled:
		case <-time.After(10 * time.Second):
			t.Fatal("the message was not handled")
		}
		cancel()
		require.NoError(t, <-done)
	}
	pollUntil(t, "the observer goroutines of the unclosed subscribers ended", 10*time.Second, nil, func() bool { return queues() <= before })
}

// Close writes its last writes (here the release of the messages in flight
// at DrainTimeout) when the pool's connections were ended just before (a
// server's idle-session timeout, a pooler's restart, pg_terminate_backend)
// while the database stays up: each write on a dead connection fails at
// once, and Close gave up after three such failures, leaving the rows to
// their leases (a handled message's ack so, redelivered although handled).
// It retries until its deadline; only failures to reach the database at
// all end it sooner (TestCloseGivesUpSoonOnADatabaseItCannotReach).
func TestCloseWritesAfterThePoolsConnectionsWereEnded(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) { closeAfterThePoolsConnectionsWereEnded(t, setup(t), path) })
}

// closeAfterThePoolsConnectionsWereEnded is the test above on one claim
// path; on the held path the batch's own connection ends with the others,
// and its rows are due again at once.
func closeAfterThePoolsConnectionsWereEnded(t *testing.T, b *bundle, path string) {
	ctx := context.Background()
	app := "ended-" + watermill.NewShortUUID()
	pool := b.poolWith(t, map[string]string{"application_name": app}, func(c *pgxpool.Config) { c.MaxConns = 10 })
	const n = 4
	require.NoError(t, b.poolPublisher(t).Publish("t", newMsgs(n)...))
	cfg := pgoutbox.SubscriberConfig{Tables: b.tables, MaxInFlight: n, DrainTimeout: 100 * time.Millisecond,
		StatementTimeout: 5 * time.Second, Lease: time.Hour}
	onPath(t, path, &cfg)
	sub, err := pgoutbox.NewSubscriber(pool, cfg, b.logger)
	require.NoError(t, err)
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	for range n {
		receive(t, msgs, 10*time.Second) // held, never answered
	}
	// Every idle connection of the pool used just now (the pool pings only
	// those idle for over a second), then ended by the server.
	var conns []*pgxpool.Conn
	for pool.Stat().IdleConns() > 0 {
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		_, err = c.Exec(ctx, "SELECT 1")
		require.NoError(t, err)
		conns = append(conns, c)
	}
	for range 6 - len(conns) {
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	ended := column[int32](t, b, `SELECT pid FROM (SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND state = 'idle') s`, app)
	require.GreaterOrEqual(t, len(ended), 4)
	pollUntil(t, "the ended sessions gone", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)`, ended) == 0
	})
	requireClosed(t, "Close", sub.Close)
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE lease_token IS NOT NULL`),
		"Close gave up releasing the messages in flight, with the database up")
}

// Close gives up its last writes soon when it cannot reach the database
// (connections refused), rather than wait out its deadline
// (StatementTimeout), as TestCloseWritesAfterThePoolsConnectionsWereEnded
// retries writes that failed on connections the server ended.
func TestCloseGivesUpSoonOnADatabaseItCannotReach(t *testing.T) {
	t.Parallel()
	b := setup(t)
	px, sub, _ := leasedThroughProxy(t, b, 2, pgoutbox.SubscriberConfig{DrainTimeout: 100 * time.Millisecond, StatementTimeout: time.Minute}, b.logger)
	px.cut() // every connection closed, new ones refused
	closed := make(chan error, 1)
	go func() { closed <- sub.Close() }()
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("Close waited for its deadline (StatementTimeout, a minute) on a database it cannot reach")
	}
}

// Close writes the acks an outage held back once the database is back: the
// writes' backoff, grown during the outage to seconds, does not outlast
// Close's deadline (StatementTimeout) while the database answers. The
// lease path: a held batch's acks end with its transaction, which the
// outage rolled back.
func TestCloseWritesTheAcksAnOutageHeldBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 8
	logs := &logCapture{}
	stmt := time.Second
	px, sub, msgs := leasedThroughProxy(t, b, n, pgoutbox.SubscriberConfig{DrainTimeout: time.Second, StatementTimeout: stmt}, logs)
	px.cut()
	for _, m := range msgs {
		m.Ack()
	}
	// Wait for a backoff longer than Close's deadline (past the first
	// failures the log has them at debug level).
	grown := func(e logEntry) bool {
		wait, err := time.ParseDuration(fmt.Sprint(e.fields["retry_in"]))
		return strings.HasPrefix(e.msg, "Writing acks") && err == nil && wait > 2*stmt
	}
	require.Eventually(t, func() bool {
		return len(logs.find("error", grown))+len(logs.find("debug", grown)) > 0
	}, time.Minute, 10*time.Millisecond, "the writes' backoff grows during the outage")
	px.restore()
	require.Equal(t, n, b.outboxRows(t, "t"), "nothing was written during the outage")
	require.NoError(t, sub.Close())
	require.Zero(t, b.outboxRows(t, "t"), "the database answered during Close: every ack is written")
	require.Empty(t, logs.find("error", func(e logEntry) bool { return strings.HasPrefix(e.msg, "Giving up") }))
}

// After claims failed for a while (an outage), the first that succeeds is
// logged at INFO: the outage's end and length show in the log, where the
// failures were logged less and less often. On every claim path.
func TestClaimsThatSucceedAgainAfterAnOutageSaySo(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		px := startTCPProxy(t, b.DSN)
		pool := px.pool(t, b, "claims-back-"+b.Schema, nil)
		logs := &logCapture{}
		cfg := pgoutbox.SubscriberConfig{Tables: b.tables, MinPollInterval: 10 * time.Millisecond, MaxPollInterval: 50 * time.Millisecond}
		onPath(t, path, &cfg)
		sub, err := pgoutbox.NewSubscriber(pool, cfg, logs)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		ch, err := sub.Subscribe(context.Background(), "t")
		require.NoError(t, err)
		px.cut()
		failed := func() bool {
			return len(logs.find("error", func(e logEntry) bool { return strings.HasPrefix(e.msg, "Claim failed") })) > 0
		}
		require.Eventually(t, failed, 30*time.Second, 10*time.Millisecond, "claims fail while the database is cut off")
		time.Sleep(1100 * time.Millisecond) // the outage lasts past claimsBackAfter: its length, not a wait for an event
		px.restore()
		require.NoError(t, b.poolPublisher(t).Publish("t", newMsg("after")))
		receive(t, ch, 30*time.Second).Ack()
		back := logs.find("info", func(e logEntry) bool { return e.msg == "Claims succeed again" })
		require.NotEmpty(t, back)
		require.NotEmpty(t, back[0].fields["failing_for"])
	})
}

// leasedThroughProxy publishes n messages to topic "t" and receives them
// with a lease-path subscriber whose connections pass a proxy the test can
// cut: cfg with the outbox's tables, ClaimLease, MaxInFlight n and a Lease
// of an hour (nothing expires during the test).
func leasedThroughProxy(t *testing.T, b *bundle, n int, cfg pgoutbox.SubscriberConfig, logger watermill.LoggerAdapter) (*tcpProxy, *pgoutbox.Subscriber, []*message.Message) {
	t.Helper()
	px := startTCPProxy(t, b.DSN)
	pool := px.pool(t, b, "leased-"+b.Schema, nil)
	require.NoError(t, b.poolPublisher(t).Publish("t", newMsgs(n)...))
	cfg.Tables, cfg.ClaimMode, cfg.MaxInFlight, cfg.Lease = b.tables, pgoutbox.ClaimLease, n, time.Hour
	sub, err := pgoutbox.NewSubscriber(pool, cfg, logger)
	require.NoError(t, err)
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	msgs := make([]*message.Message, 0, n)
	for range n {
		msgs = append(msgs, receive(t, ch, 10*time.Second))
	}
	return px, sub, msgs
}
