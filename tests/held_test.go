package tests

// Tests of the held path (ClaimMode; pkg/pgoutbox/held.go): a busy
// subscription locks a batch of rows in a transaction it keeps open while
// the handlers run, and ends it at a short bound (heldBound, 100ms).
//
// Even with ClaimHeld some claims lease: a subscription's first claim (it
// looks for expired leases), its look for orphaned rows shortly after it
// starts, a look for expired leases every second, a claim that finds every
// held batch open for more than a moment. So
// most tests publish their messages before they subscribe (the
// subscription is busy from its first claim, whose rows lease), and they
// assert what the held path did (PathHeld claims, EventHeldToLease), not
// that every claim was a held one. Where one batch must be held, the test
// checks that it was and otherwise tries again on a new topic.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// heldBoundForTests mirrors pgoutbox's heldBound: how long a held
// transaction waits for its handlers before their rows become leases.
const heldBoundForTests = 100 * time.Millisecond

// heldPool opens a pool for a subscriber whose backends the test finds in
// pg_stat_activity by application_name (returned), closed when the test
// ends. A few connections are opened up front, so the first claims do not
// wait for dials.
func heldPool(t *testing.T, b *bundle, maxConns int32) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	app := "pgoutbox-held-" + b.Schema
	cfg, err := pgxpool.ParseConfig(b.DSN)
	require.NoError(t, err)
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	warmUpPool(t, pool, 4)
	return pool, app
}

// warmUpPool opens n connections of pool and leaves them idle in it.
func warmUpPool(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	conns := make([]*pgxpool.Conn, n)
	for i := range conns {
		c, err := pool.Acquire(context.Background())
		require.NoError(t, err)
		conns[i] = c
	}
	for _, c := range conns {
		c.Release()
	}
}

// heldSubscriber is bundle.subscriber on pool, on the held path
// (ClaimHeld), then mod.
func (b *bundle) heldSubscriber(t *testing.T, pool *pgxpool.Pool, mod func(*pgoutbox.SubscriberConfig)) *pgoutbox.Subscriber {
	t.Helper()
	return b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode = pgoutbox.ClaimHeld
		if mod != nil {
			mod(c)
		}
	})
}

// publishReturningIDs publishes msgs in one transaction and returns their row
// ids (id -> UUID), read in that transaction: once it commits the rows may
// be claimed and deleted at once.
func (b *bundle) publishReturningIDs(t *testing.T, topic string, msgs ...*message.Message) map[int64]string {
	t.Helper()
	ctx := context.Background()
	pgTx, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = pgTx.Rollback(ctx) }()
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, msgs...))
	rows, err := pgTx.Query(ctx, `SELECT id, uuid FROM `+b.Schema+`.outbox WHERE topic = $1`, topic)
	require.NoError(t, err)
	ids := map[int64]string{}
	for rows.Next() {
		var id int64
		var uuid string
		require.NoError(t, rows.Scan(&id, &uuid))
		ids[id] = uuid
	}
	require.NoError(t, rows.Err())
	require.NoError(t, pgTx.Commit(ctx))
	return ids
}

// eventsOfKind returns the events of a kind, in order.
func eventsOfKind(evs []pgoutbox.Event, kind pgoutbox.EventKind) []pgoutbox.Event {
	var out []pgoutbox.Event
	for _, e := range evs {
		if e.Kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// rowsClaimedOnPath sums the rows of the claims on path.
func rowsClaimedOnPath(evs []pgoutbox.Event, path string) int {
	n := 0
	for _, e := range eventsOfKind(evs, pgoutbox.EventClaimed) {
		if e.Path == path {
			n += e.Count
		}
	}
	return n
}

// handlingCounts counts handlings per key, safely from handlers.
type handlingCounts struct {
	mu sync.Mutex
	n  map[string]int
}

func newHandlingCounts() *handlingCounts { return &handlingCounts{n: map[string]int{}} }

// add counts one handling of key and returns how many it had.
func (c *handlingCounts) add(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n[key]++
	return c.n[key]
}

func (c *handlingCounts) get(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[key]
}

func (c *handlingCounts) distinct() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.n)
}

func (c *handlingCounts) total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := 0
	for _, n := range c.n {
		t += n
	}
	return t
}

// openTxSampler samples, every 10ms, the open transactions (xact_start set)
// of the backends named app; the sampler's own backend, of another pool,
// is left out.
type openTxSampler struct {
	stopC chan struct{}
	done  chan struct{}

	// Written by the sampling goroutine; read after done is closed.
	samples int
	withTx  int // samples that saw a transaction open
	// Backends idle in transaction: a transaction waiting for the
	// subscriber, such as a held batch while its handlers run.
	idleInTxSamples int           // samples that saw one
	oldestIdle      time.Duration // the oldest one's age
	oldestAt        string        // pg_stat_activity of its sample
	// Every open transaction, whatever its state.
	oldest time.Duration
	err    error
}

func sampleOpenTransactions(pool *pgxpool.Pool, app string) *openTxSampler {
	s := &openTxSampler{stopC: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-s.stopC:
				return
			case <-tick.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			var open, idle int
			var ageMs, idleAgeMs float64
			var what string
			err := pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE state = 'idle in transaction'),
				coalesce(max(extract(epoch FROM clock_timestamp() - xact_start) * 1000), 0)::float8,
				coalesce(max(extract(epoch FROM clock_timestamp() - xact_start) * 1000) FILTER (WHERE state = 'idle in transaction'), 0)::float8,
				coalesce(string_agg(format('pid %s %s for %s: %s', pid, state, clock_timestamp() - xact_start, left(query, 80)), '; '), '')
				FROM pg_stat_activity WHERE application_name = $1 AND xact_start IS NOT NULL AND pid <> pg_backend_pid()`, app).
				Scan(&open, &idle, &ageMs, &idleAgeMs, &what)
			cancel()
			if err != nil {
				s.err = err
				return
			}
			s.samples++
			if open > 0 {
				s.withTx++
			}
			if idle > 0 {
				s.idleInTxSamples++
			}
			s.oldest = max(s.oldest, time.Duration(ageMs*float64(time.Millisecond)))
			if age := time.Duration(idleAgeMs * float64(time.Millisecond)); age > s.oldestIdle {
				s.oldestIdle, s.oldestAt = age, what
			}
		}
	}()
	return s
}

// stop ends the sampling and waits for it; idempotent.
func (s *openTxSampler) stop() {
	select {
	case <-s.stopC:
	default:
		close(s.stopC)
	}
	<-s.done
}

// awaitFirstClaim waits for the subscription's first claim (an empty one,
// when it runs before anything is published: a lease claim, it looks for
// expired leases).
func awaitFirstClaim(t *testing.T, ev *events) {
	t.Helper()
	ev.wait(t, pgoutbox.EventClaimed, 10*time.Second)
}

// The held transaction never outlives its bound by much, whatever the
// handlers do: 5,000 messages, MaxInFlight 16, one message in 1,000 handled
// in 2s. Every ~10ms the test samples the subscriber's backends with a
// transaction open in pg_stat_activity. Held transactions are seen, and no
// transaction waiting for the subscriber (idle in transaction: a held
// batch while its handlers run) is ever older than the bound plus a margin
// of 1s. The margin covers, on a loaded 2-core machine under -race, the
// owner goroutine's turn at the bound, the finishing statements' round
// trip and the sampling period, and stays well under the 2s a transaction
// kept open for a slow handler would reach. Transactions in another state
// are only logged: a statement running, or one the server has begun (a
// pipeline's Bind starts the transaction) without reporting it yet (state
// still "idle", with the previous query), measures the server, which a
// loaded machine stalls for more than a second at times. The slow
// messages' rows became leases, and while the first slow handler runs the
// other messages keep being handled. Every message is handled once; the
// outbox ends empty.
func TestHeldTransactionsStayShortWhileSomeHandlersAreSlow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const (
		n         = 5000
		slowEvery = 1000
		slowFor   = 2 * time.Second
		maxTxAge  = heldBoundForTests + time.Second
	)
	pool, app := heldPool(t, b, 10)
	ev := newEvents()
	sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.MaxInFlight = 16
		c.Observer = ev
	})
	s := sampleOpenTransactions(b.Pool, app)
	t.Cleanup(s.stop)
	b.publishInTx(t, "t", true, newMsgs(n)...)

	handled := newHandlingCounts()
	var count atomic.Int64
	slowStarted := make(chan string, 1)
	release := make(chan struct{})
	var first atomic.Bool
	runRouter(t, sub, "t", func(m *message.Message) error {
		i, err := strconv.Atoi(string(m.Payload))
		if err != nil {
			return err
		}
		if i%slowEvery == slowEvery/2 {
			isFirst := first.CompareAndSwap(false, true)
			if isFirst {
				slowStarted <- m.UUID
			}
			time.Sleep(slowFor) // the slow handler's work
			if isFirst {
				// And on until the test saw the others progress.
				select {
				case <-release:
				case <-time.After(30 * time.Second):
				}
			}
		}
		handled.add(m.UUID)
		count.Add(1)
		return nil
	})
	releaseSlow := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseSlow) // before the Router closes

	var slowUUID string
	select {
	case slowUUID = <-slowStarted:
	case <-time.After(30 * time.Second):
		t.Fatal("the first slow message was not delivered")
	}
	base := count.Load()
	pollUntil(t, "messages are handled while the first slow handler runs", 30*time.Second, nil, func() bool {
		return count.Load() >= base+200
	})
	pollUntil(t, "the slow message's row became a lease", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE uuid = $1 AND lease_token IS NOT NULL`, slowUUID) == 1
	})
	releaseSlow()

	waitCount(t, "handled", n, 60*time.Second, handled.distinct)
	pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
	s.stop()
	require.NoError(t, s.err)
	evs := ev.snapshot()
	t.Logf("samples=%d with_tx=%d idle_in_tx=%d oldest_idle_in_tx=%s oldest_any=%s; rows claimed held=%d lease=%d",
		s.samples, s.withTx, s.idleInTxSamples, s.oldestIdle, s.oldest, rowsClaimedOnPath(evs, pgoutbox.PathHeld), rowsClaimedOnPath(evs, pgoutbox.PathLease))
	require.Positive(t, s.idleInTxSamples, "no held transaction was ever seen: the test proves nothing")
	require.Less(t, s.oldestIdle, maxTxAge, "a transaction stayed open too long: %s", s.oldestAt)

	require.Equal(t, n, handled.total(), "every message handled once")
	pollUntil(t, "rows became leases", 10*time.Second, nil, func() bool { return ev.countKind(pgoutbox.EventHeldToLease) > 0 })
	for _, e := range eventsOfKind(ev.snapshot(), pgoutbox.EventHeldToLease) {
		require.GreaterOrEqual(t, e.Count, 1)
	}
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
}

// Events tell the path. On ClaimHeld, a drain uses the held path (claims
// with PathHeld, acks with PathHeld), and the paths add up: every row a
// held claim took ends in its batch, acked there (acked with PathHeld),
// given back (released with PathHeld) or made a lease (EventHeldToLease),
// and every row claimed as a lease or made one is acked or released with
// PathLease. (Not every claim is a held one: see the top of the file.) On
// ClaimLease every claimed, acked and released event carries PathLease,
// and no row becomes a lease from a held batch. No claimed, acked or
// released event lacks its path.
func TestHeldEventsTellThePath(t *testing.T) {
	t.Parallel()
	for name, mode := range map[string]pgoutbox.ClaimMode{"Held": pgoutbox.ClaimHeld, "Lease": pgoutbox.ClaimLease} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			pool, _ := heldPool(t, b, 10)
			ev := newEvents()
			sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
				c.ClaimMode = mode
				c.MaxInFlight = 4
				c.Observer = ev
			})
			const n = 40
			b.publishInTx(t, "t", true, newMsgs(n)...)
			msgs, err := sub.Subscribe(context.Background(), "t")
			require.NoError(t, err)
			go func() {
				for m := range msgs {
					m.Ack()
				}
			}()
			pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
			pollUntil(t, "every ack observed", 10*time.Second, nil, func() bool { return ev.countKind(pgoutbox.EventAcked) >= n })
			require.NoError(t, sub.Close()) // the Observer has every event once Close returns

			evs := ev.snapshot()
			claimed, acked, released := eventsOfKind(evs, pgoutbox.EventClaimed), eventsOfKind(evs, pgoutbox.EventAcked), eventsOfKind(evs, pgoutbox.EventReleased)
			require.Len(t, acked, n)
			onPath := func(list []pgoutbox.Event, path string) int {
				k := 0
				for _, e := range list {
					if e.Path == path {
						k++
					}
				}
				return k
			}
			toLease := 0
			for _, e := range eventsOfKind(evs, pgoutbox.EventHeldToLease) {
				toLease += e.Count
			}
			for _, e := range append(append(claimed, acked...), released...) {
				require.Contains(t, []string{pgoutbox.PathHeld, pgoutbox.PathLease}, e.Path,
					"a %s event (row %d, count %d) without its path", e.Kind, e.RowID, e.Count)
			}
			switch mode {
			case pgoutbox.ClaimLease:
				require.Equal(t, len(claimed), onPath(claimed, pgoutbox.PathLease), "claims on the lease path")
				require.Equal(t, n, onPath(acked, pgoutbox.PathLease), "acks on the lease path")
				require.Equal(t, len(released), onPath(released, pgoutbox.PathLease), "releases on the lease path")
				require.Zero(t, toLease)
			case pgoutbox.ClaimHeld:
				held := rowsClaimedOnPath(evs, pgoutbox.PathHeld)
				require.Positive(t, held, "no held claim took rows: the drain did not use the held path")
				require.Positive(t, onPath(acked, pgoutbox.PathHeld), "no row was acked in its held batch")
				require.Equal(t, held, onPath(acked, pgoutbox.PathHeld)+onPath(released, pgoutbox.PathHeld)+toLease,
					"every held row ends in its batch: acked, given back or made a lease")
				require.Equal(t, rowsClaimedOnPath(evs, pgoutbox.PathLease)+toLease, onPath(acked, pgoutbox.PathLease)+onPath(released, pgoutbox.PathLease),
					"every leased row (claimed as a lease, or made one) is acked or released as a lease")
			}
		})
	}
}

// A nack on the held path makes its row a lease in the batch's
// transaction, and its retry is written like a lease's: 100 messages,
// MaxInFlight 8, every fourth one failing its first delivery, with a retry
// policy of two deliveries (a nack counted twice would dead-letter the
// message instead). Each failing message is delivered exactly twice and the
// others once; each is acked exactly once, the acks counting 2 and 1
// deliveries; one retry per failing message, counting 1; its stored error
// and delivery count are there at the second delivery; the dead-letter
// table stays empty, no lease is lost, and held rows became leases.
func TestHeldNackedMessagesAreRetriedAndAckedOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, _ := heldPool(t, b, 10)
	ev := newEvents()
	sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.MaxInFlight = 8
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 50 * time.Millisecond, MaxAttempts: 2}
		c.Observer = ev
	})
	const n = 100
	msgs := newMsgs(n)
	ids := b.publishReturningIDs(t, "t", msgs...)
	require.Len(t, ids, n)

	type stored struct {
		deliveries int
		lastError  string
		err        error
	}
	calls, acked := newHandlingCounts(), newHandlingCounts()
	var mu sync.Mutex
	atRetry := map[string]stored{} // what the row held at its second delivery
	runRouter(t, sub, "t", func(m *message.Message) error {
		i, err := strconv.Atoi(string(m.Payload))
		if err != nil {
			return err
		}
		call := calls.add(m.UUID)
		if i%4 == 0 && call == 1 {
			return fmt.Errorf("first delivery of %d fails", i)
		}
		if call == 2 {
			var s stored
			var lastErr *string
			s.err = b.Pool.QueryRow(context.Background(), `SELECT deliveries, last_error FROM `+b.Schema+`.outbox WHERE uuid = $1`,
				m.UUID).Scan(&s.deliveries, &lastErr)
			if lastErr != nil {
				s.lastError = *lastErr
			}
			mu.Lock()
			atRetry[m.UUID] = s
			mu.Unlock()
		}
		acked.add(m.UUID)
		return nil
	}, pgoutbox.ErrorRecorder)

	waitCount(t, "acked", n, 30*time.Second, acked.distinct)
	pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
	pollUntil(t, "every ack observed", 10*time.Second, nil, func() bool { return ev.countKind(pgoutbox.EventAcked) >= n })

	failing := map[string]bool{}
	for i, m := range msgs {
		failing[m.UUID] = i%4 == 0
		want := 1
		if failing[m.UUID] {
			want = 2
		}
		require.Equal(t, want, calls.get(m.UUID), "deliveries of message %d", i)
		require.Equal(t, 1, acked.get(m.UUID), "acks of message %d", i)
	}
	mu.Lock()
	require.Len(t, atRetry, n/4)
	for u, s := range atRetry {
		require.True(t, failing[u])
		require.NoError(t, s.err)
		// 1: the nack counted the first delivery; 2 when a lease claim
		// took the row again (a held claim counts it only if the row
		// becomes a lease).
		require.Contains(t, []int{1, 2}, s.deliveries)
		require.Regexp(t, `^first delivery of \d+ fails$`, s.lastError)
	}
	mu.Unlock()

	evs := ev.snapshot()
	retried := eventsOfKind(evs, pgoutbox.EventRetried)
	require.Len(t, retried, n/4)
	for _, e := range retried {
		require.True(t, failing[ids[e.RowID]], "row %d retried", e.RowID)
		require.Equal(t, 1, e.Deliveries)
	}
	ackEvents := eventsOfKind(evs, pgoutbox.EventAcked)
	require.Len(t, ackEvents, n)
	seen := map[int64]bool{}
	for _, e := range ackEvents {
		require.False(t, seen[e.RowID], "row %d acked twice", e.RowID)
		seen[e.RowID] = true
		want := 1
		if failing[ids[e.RowID]] {
			want = 2
		}
		require.Equal(t, want, e.Deliveries, "row %d", e.RowID)
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
	require.Positive(t, rowsClaimedOnPath(evs, pgoutbox.PathHeld), "no held claim took rows")
	require.Positive(t, ev.countKind(pgoutbox.EventHeldToLease), "no held row became a lease: no nack on the held path")
}

// A message rejected on the held path (pgoutbox.Reject) becomes a lease in
// its batch's transaction and then moves to the dead-letter table like a
// leased one: reason "rejected", deliveries 1, the rejection as its error,
// its payload intact. Every message is handled once, the others are acked,
// the outbox ends empty, no lease is lost, and held rows became leases.
func TestHeldRejectedMessagesMoveToTheDeadLetterTable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, _ := heldPool(t, b, 10)
	ev := newEvents()
	sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.MaxInFlight = 4
		c.Observer = ev
	})
	const n, rejected = 50, 10
	msgs := newMsgs(n)
	b.publishInTx(t, "t", true, msgs...)
	calls := newHandlingCounts()
	runRouter(t, sub, "t", func(m *message.Message) error {
		calls.add(m.UUID)
		i, err := strconv.Atoi(string(m.Payload))
		if err != nil {
			return err
		}
		if i%5 == 2 {
			return pgoutbox.Reject(m, "bad "+string(m.Payload))
		}
		return nil
	})
	pollUntil(t, "the rejected messages are dead-lettered", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`) == rejected
	})
	pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
	for i, m := range msgs {
		require.Equal(t, 1, calls.get(m.UUID), "message %d handled once", i)
		if i%5 != 2 {
			continue
		}
		row := b.dlq(t, m.UUID)
		require.Equal(t, pgoutbox.ReasonRejected, row.reason)
		require.Equal(t, 1, row.deliveries)
		require.Equal(t, "rejected: bad "+strconv.Itoa(i), row.lastError)
		require.Equal(t, m.Payload, message.Payload(row.payload))
	}
	pollUntil(t, "dead-letter events observed", 10*time.Second, nil, func() bool {
		return ev.countKind(pgoutbox.EventDeadLettered) >= rejected
	})
	evs := ev.snapshot()
	dead := eventsOfKind(evs, pgoutbox.EventDeadLettered)
	require.Len(t, dead, rejected)
	for _, e := range dead {
		require.Equal(t, pgoutbox.ReasonRejected, e.Reason)
		require.Equal(t, 1, e.Deliveries)
	}
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
	require.Positive(t, rowsClaimedOnPath(evs, pgoutbox.PathHeld), "no held claim took rows")
	require.Positive(t, ev.countKind(pgoutbox.EventHeldToLease), "no held row became a lease: no rejection on the held path")
}

// TestOrderedNackIsRedeliveredBeforeLaterMessages on the held path: with
// MaxInFlight 1 a nacked message is delivered again before any later one,
// with or without a retry delay. The handler nacks the first message from
// the 20th on whose row is held (locked in a held batch, not leased): a
// leased row would prove nothing. The held path is forced
// (internal/testhook), but a forced claim still leases when the
// subscription has maxHeldBatches open (on a loaded machine the first
// claims are small, and their batches stay open until their handlers are
// done), so which row is held is not fixed in advance. The nack makes the
// held row a lease (EventHeldToLease), ends its batch, and its hold is
// written after that commit; no lease is lost.
func TestHeldOrderedNackIsRedeliveredBeforeLaterMessages(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		n, nack int
		delay   time.Duration
	}{
		"NoDelay":   {n: 300, nack: 20},
		"WithDelay": {n: 300, nack: 20, delay: 200 * time.Millisecond},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			pool, _ := heldPool(t, b, 10)
			const topic = "t"
			ev := newEvents()
			sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
				onPath(t, testhook.PathHeld, c) // every claim held, the first ones too
				// A batch holds its rows until its handlers are done, on a
				// loaded machine too: the nacked row is held when it runs.
				id := c.WorkerID
				testhook.SetHeldBound(id, time.Minute)
				t.Cleanup(func() { testhook.SetHeldBound(id, 0) })
				c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: tc.delay, MaxAttempts: -1}
				c.Observer = ev
			})
			b.publishInTx(t, topic, true, newMsgs(tc.n)...)
			seen := &list{}
			var nackedAt atomic.Int64 // the payload nacked, -1 until then
			nackedAt.Store(-1)
			runRouter(t, sub, topic, func(m *message.Message) error {
				seen.add(string(m.Payload))
				i, _ := strconv.Atoi(string(m.Payload))
				if i >= tc.nack && nackedAt.Load() < 0 {
					var leased bool
					err := b.Pool.QueryRow(context.Background(), `SELECT lease_token IS NOT NULL FROM `+b.Schema+`.outbox WHERE uuid = $1`,
						m.UUID).Scan(&leased)
					if err == nil && !leased && nackedAt.CompareAndSwap(-1, int64(i)) {
						return errors.New("once")
					}
				}
				return nil
			})
			waitCount(t, "handled", tc.n+1, 30*time.Second, func() int { return len(seen.get()) })
			nacked := int(nackedAt.Load())
			require.GreaterOrEqual(t, nacked, tc.nack, "a held row was nacked")
			require.Equal(t, orderedSeq(tc.n, nacked), seen.get())
			pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, topic) == 0 })
			pollUntil(t, "the retry observed", 10*time.Second, nil, func() bool { return ev.countKind(pgoutbox.EventRetried) >= 1 })
			require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
			pollUntil(t, "the nacked held row became a lease", 10*time.Second, nil, func() bool {
				return ev.countKind(pgoutbox.EventHeldToLease) >= 1
			})
		})
	}
}

// tx.Middleware on the held path: 500 messages, MaxInFlight 8, each
// handled in a transaction that inserts a row of the test's table and
// deletes the message's outbox row (the middleware). The row's batch ends
// at once for it, so the DELETE does not wait for the held lock. Every
// message commits exactly once, the outbox ends empty, no handler fails
// (no ErrLeaseLost), no lease is lost, and held rows became leases.
func TestHeldTxMiddlewareCompletesEveryMessageOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	ctx := context.Background()
	_, err := b.Pool.Exec(ctx, `CREATE TABLE `+b.Schema+`.handled (uuid text NOT NULL)`)
	require.NoError(t, err)
	pool, _ := heldPool(t, b, 20) // handlers' transactions, held batches, completer, claims
	h := newTxHandlerBed(t, pool, b)
	ev := newEvents()
	sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.MaxInFlight = 8
		c.Observer = ev
	})
	const n = 500
	b.publishInTx(t, "in", true, newMsgs(n)...)
	var errMu sync.Mutex
	var handlerErrs []error
	recordErrs := func(next message.HandlerFunc) message.HandlerFunc { // outside tx.Middleware: sees its result
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := next(m)
			if err != nil {
				errMu.Lock()
				handlerErrs = append(handlerErrs, err)
				errMu.Unlock()
			}
			return out, err
		}
	}
	runRouter(t, sub, "in", func(m *message.Message) error {
		pgTx, ok := tx.PgxTxFromContext(m.Context())
		if !ok {
			return errors.New("no transaction in the handler's context")
		}
		_, err := pgTx.Exec(m.Context(), `INSERT INTO `+b.Schema+`.handled VALUES ($1)`, m.UUID)
		return err
	}, recordErrs, h.mw)
	pollUntil(t, "every message completed", 60*time.Second, nil, func() bool { return b.outboxRows(t, "in") == 0 })
	pollUntil(t, "every ack observed", 10*time.Second, nil, func() bool { return ev.countKind(pgoutbox.EventAcked) >= n })

	require.Equal(t, n, b.count(t, `SELECT count(*) FROM `+b.Schema+`.handled`), "each message committed once")
	require.Equal(t, n, b.count(t, `SELECT count(DISTINCT uuid) FROM `+b.Schema+`.handled`))
	errMu.Lock()
	for _, err := range handlerErrs {
		require.NotErrorIs(t, err, tx.ErrLeaseLost)
	}
	require.Empty(t, handlerErrs, "no handler failed")
	errMu.Unlock()
	evs := ev.snapshot()
	require.Len(t, eventsOfKind(evs, pgoutbox.EventAcked), n)
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
	require.Positive(t, rowsClaimedOnPath(evs, pgoutbox.PathHeld), "no held claim took rows")
	require.Positive(t, ev.countKind(pgoutbox.EventHeldToLease), "no held row became a lease for its handler's transaction")
}

// idleInTxOf is the pg_stat_activity condition of an open held batch's
// backend (waiting for its handlers), for application_name $1. A held
// claim that locked nothing is idle in transaction too, between its
// statement and its ROLLBACK (a loaded machine stretches that): it has no
// transaction id, which a row lock takes.
const idleInTxOf = `application_name = $1 AND state = 'idle in transaction' AND backend_xid IS NOT NULL AND pid <> pg_backend_pid()`

// A held batch whose connection is terminated while its handlers are
// blocked: the server rolls its transaction back, so its rows are due again
// at once. Each round publishes 16 quick messages (in the first round the
// subscription's first claim, a lease one, takes them) and then 8 whose
// handlers block; when one of those runs, the subscriber's backends idle
// in transaction (its held batches) are terminated. Rounds go on until one
// caught a batch open (a round that did not unblocks its handlers). Once the
// handlers are unblocked every message is handled at least once
// (duplicates allowed: at-least-once), the outbox ends empty, and Close
// returns.
func TestHeldBatchWhoseConnectionIsKilledIsDeliveredAgain(t *testing.T) {
	for _, layout := range []string{"outbox", "arrivals"} {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			heldBatchWhoseConnectionIsKilled(t, layoutBundle(t, layout))
		})
	}
}

// heldBatchWhoseConnectionIsKilled is TestHeldBatchWhoseConnectionIsKilledIsDeliveredAgain
// on b's outbox: with arrivals (schema.Config.Arrivals), the held rows are
// arrivals, locked where they arrived.
func heldBatchWhoseConnectionIsKilled(t *testing.T, b *bundle) {
	ctx := context.Background()
	pool, app := heldPool(t, b, 10)
	ev := newEvents()
	sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.MaxInFlight = 16
		c.Lease = 2 * time.Second // a row left leased comes back within it
		c.Observer = ev
	})
	const rounds = 10
	// Each round's blocked handlers wait for its gate: a round that caught
	// no batch open frees its handlers' slots before the next one.
	gates := make([]chan struct{}, rounds)
	openGates := make([]func(), rounds)
	for i := range gates {
		gates[i] = make(chan struct{})
		openGates[i] = sync.OnceFunc(func() { close(gates[i]) })
		t.Cleanup(openGates[i])
	}
	handled := newHandlingCounts()
	started := make(chan struct{}, 1024)
	consumed := make(chan struct{})
	consume := func(msgs <-chan *message.Message) {
		defer close(consumed)
		var wg sync.WaitGroup
		for m := range msgs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				handled.add(m.UUID)
				var round int
				if _, err := fmt.Sscanf(string(m.Payload), "block %d", &round); err == nil {
					started <- struct{}{}
					<-gates[round]
				}
				m.Ack()
			}()
		}
		wg.Wait()
	}

	var published []string
	killed, round := 0, 0
	for ; round < rounds && killed == 0; round++ {
		if round > 0 {
			openGates[round-1]()
		}
		for len(started) > 0 { // forget the earlier rounds' handlers
			<-started
		}
		ms := newMsgs(16)
		for range 8 {
			ms = append(ms, newMsg(fmt.Sprintf("block %d", round)))
		}
		for _, m := range ms {
			published = append(published, m.UUID)
		}
		b.publishInTx(t, "t", true, ms...)
		if round == 0 {
			msgs, err := sub.Subscribe(ctx, "t")
			require.NoError(t, err)
			go consume(msgs)
		}
		select {
		case <-started: // a blocked handler runs: its batch is held until the bound
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: no blocking message delivered", round)
		}
		for deadline := time.Now().Add(3 * heldBoundForTests); killed == 0 && time.Now().Before(deadline); {
			require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 2000))
				FROM pg_stat_activity WHERE `+idleInTxOf, app).Scan(&killed))
		}
	}
	t.Logf("rounds=%d: terminated %d backends idle in transaction", round, killed)
	require.Positive(t, killed, "no held batch was caught open in %d rounds", rounds)
	for _, open := range openGates {
		open()
	}

	pollUntil(t, "outbox empty", 30*time.Second, nil, func() bool {
		return b.waiting(t, "t") == 0
	})
	for _, u := range published {
		require.GreaterOrEqual(t, handled.get(u), 1, "message %s never handled", u)
	}
	require.Equal(t, len(published), handled.distinct(), "only published messages are handled")
	requireClosed(t, "Close", sub.Close)
	select {
	case <-consumed:
	case <-time.After(10 * time.Second):
		t.Fatal("the message channel was not closed")
	}
	t.Logf("published=%d handled=%d (duplicates %d) lease_lost=%d held_to_lease=%d",
		len(published), handled.total(), handled.total()-len(published), ev.countKind(pgoutbox.EventLeaseLost), ev.countKind(pgoutbox.EventHeldToLease))
}

// Close while a held batch is open: 16 quick messages (the first claim, a
// lease one, takes them), then 10 more, three acked at once and seven
// whose handlers block. Once all are handed out and a held batch is open
// (idle in transaction: the test's bound keeps it open, internal/testhook),
// Close with DrainTimeout 300ms. Close returns; the acked
// rows are gone, the seven others are back in the outbox unleased and due,
// their delivery counted at most once; the late Acks of their handlers
// change nothing, and a new subscriber gets exactly those seven.
func TestHeldCloseWhileABatchIsOpenGivesItsRowsBack(t *testing.T) {
	for _, layout := range []string{"outbox", "arrivals"} {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			heldCloseWhileABatchIsOpen(t, layoutBundle(t, layout))
		})
	}
}

// heldCloseWhileABatchIsOpen is TestHeldCloseWhileABatchIsOpenGivesItsRowsBack
// on b's outbox: with arrivals, the held rows given back are arrivals again.
func heldCloseWhileABatchIsOpen(t *testing.T, b *bundle) {
	ctx := context.Background()
	pool, app := heldPool(t, b, 10)
	topic := "t"
	sent := newMsgs(16)
	for i := range 10 {
		sent = append(sent, newMsg(fmt.Sprintf("x%d", i)))
	}
	b.publishInTx(t, topic, true, sent...)
	ev := newEvents()
	sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.MaxInFlight = 16
		c.DrainTimeout = 300 * time.Millisecond
		c.Observer = ev
		// The batches stay open while their handlers run, however
		// slow the machine: Close finds one.
		c.WorkerID = "test-held-close-" + b.Schema
		id := c.WorkerID
		testhook.SetHeldBound(id, time.Minute)
		t.Cleanup(func() { testhook.SetHeldBound(id, 0) })
	})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	gate := make(chan struct{})
	openGate := sync.OnceFunc(func() { close(gate) })
	t.Cleanup(openGate)
	var quick atomic.Int32
	blocked := newHandlingCounts()
	lateAcks := make(chan struct{}, 16)
	go func() {
		for m := range msgs {
			go func() {
				if p := string(m.Payload); p[0] != 'x' || p < "x3" {
					m.Ack()
					quick.Add(1)
					return
				}
				blocked.add(m.UUID)
				<-gate
				m.Ack()
				lateAcks <- struct{}{}
			}()
		}
	}()
	pollUntil(t, "all handed out", 10*time.Second, nil, func() bool { return quick.Load() == 16+3 && blocked.distinct() == 7 })
	require.Positive(t, b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE `+idleInTxOf, app), "a held batch is open when Close is due")

	requireClosed(t, "Close", sub.Close)
	require.Positive(t, rowsClaimedOnPath(ev.snapshot(), pgoutbox.PathHeld), "no held claim took rows")
	openGate()
	for range 7 {
		select {
		case <-lateAcks:
		case <-time.After(10 * time.Second):
			t.Fatal("a blocked handler did not finish")
		}
	}

	left := `SELECT uuid, deliveries, lease_token IS NULL AND leased_until IS NULL, available_at <= now()
		FROM ` + b.Schema + `.outbox WHERE topic = $1`
	if b.tables.Arrivals {
		left += ` UNION ALL SELECT uuid, 0, true, created_at <= now() FROM ` + b.Schema + `.outbox_arrivals WHERE topic = $1`
	}
	rows, err := b.Pool.Query(ctx, left, topic)
	require.NoError(t, err)
	back := map[string]bool{}
	for rows.Next() {
		var u string
		var deliveries int
		var unleased, due bool
		require.NoError(t, rows.Scan(&u, &deliveries, &unleased, &due))
		back[u] = true
		require.True(t, unleased, "row %s still leased after Close", u)
		require.True(t, due, "row %s not due at once", u)
		require.LessOrEqual(t, deliveries, 1, "row %s", u)
	}
	require.NoError(t, rows.Err())
	require.Len(t, back, 7, "the acked rows are gone, the others back")
	for u := range back {
		require.Equal(t, 1, blocked.get(u), "row %s was not one of the blocked messages", u)
	}

	next, err := b.heldSubscriber(t, b.Pool, nil).Subscribe(ctx, topic)
	require.NoError(t, err)
	got := map[string]bool{}
	for range 7 {
		m := receive(t, next, 10*time.Second)
		got[m.UUID] = true
		m.Ack()
	}
	require.Equal(t, back, got)
	pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool {
		return b.waiting(t, topic) == 0
	})
}

// ClaimAuto claims on the held path (once busy) until a handler completes
// a held row in its own transaction (tx.Middleware, whose DELETE would wait
// for the held lock); from then on it leases, for good (see ClaimAuto). A
// test hook makes the subscription count as busy from its first claim, so
// the first messages are held whatever the machine's speed (a slow claim
// alone would make ClaimAuto lease); every other rule is ClaimAuto's own.
// Once they are done, the next messages are claimed as leases and no held
// row becomes a lease any more. The one exception is the claim that was
// under way when the switch happened (the first claim after the first
// messages' acks): it may be a held one. Every message is processed once.
func TestHeldAutoLeasesOnceAHandlerUsesItsOwnTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	pool, _ := heldPool(t, b, 20)
	h := newTxHandlerBed(t, pool, b)
	const topic = "in"
	ev := newEvents()
	sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode = pgoutbox.ClaimAuto
		c.MaxInFlight = 4
		c.Observer = ev
		onPath(t, testhook.PathAutoBusy, c)
	})
	runRouter(t, sub, topic, h.increment, h.mw)
	awaitFirstClaim(t, ev)
	base := h.counter(t)

	const first = 9
	b.publishInTx(t, topic, true, newMsgs(first)...)
	pollUntil(t, "the first messages processed", 10*time.Second, nil, func() bool { return h.counter(t) == base+first })
	pollUntil(t, "their acks observed", 10*time.Second, nil, func() bool { return ev.countKind(pgoutbox.EventAcked) >= first })
	before := ev.snapshot()
	require.Positive(t, rowsClaimedOnPath(before, pgoutbox.PathHeld), "the first messages were claimed on the held path")
	require.Positive(t, ev.countKind(pgoutbox.EventHeldToLease), "the held rows became leases for their handlers' transactions")

	const next = 20
	b.publishInTx(t, topic, true, newMsgs(next)...)
	pollUntil(t, "the next messages processed", 20*time.Second, nil, func() bool { return h.counter(t) == base+first+next })
	pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, topic) == 0 })
	pollUntil(t, "their acks observed", 10*time.Second, nil, func() bool { return ev.countKind(pgoutbox.EventAcked) >= first+next })
	after := ev.snapshot()[len(before):]
	claims := eventsOfKind(after, pgoutbox.EventClaimed)
	require.NotEmpty(t, claims)
	underWay := 0 // rows of a held claim under way at the switch
	if claims[0].Path == pgoutbox.PathHeld {
		underWay = claims[0].Count
	}
	for _, e := range claims[1:] {
		require.Equal(t, pgoutbox.PathLease, e.Path, "a claim (count %d) after a handler's transaction completed a held row", e.Count)
	}
	require.Equal(t, next, rowsClaimedOnPath(after, pgoutbox.PathLease)+underWay, "the next messages were claimed as leases")
	toLease := 0
	for _, e := range eventsOfKind(after, pgoutbox.EventHeldToLease) {
		toLease += e.Count
	}
	require.Equal(t, underWay, toLease, "only the rows of the claim under way were held")
	require.Equal(t, base+first+next, h.counter(t), "each message processed once")
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
}

// One nack on an ordered ClaimAuto subscription ends its batch at once (the
// retry waits for its write): the rows still buffered in that batch say
// nothing about the handlers' speed, and the held path goes on.
func TestHeldOrderedNackDoesNotTurnTheHeldPathOff(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, _ := heldPool(t, b, 10)
	const n = 6000
	pub := b.poolPublisher(t)
	msgs := newMsgs(n)
	for i := 0; i < n; i += 1000 {
		require.NoError(t, pub.Publish("t", msgs[i:i+1000]...))
	}
	ev := newEvents()
	sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) { c.Observer = ev }) // ClaimAuto, MaxInFlight 1
	var handled atomic.Int32
	var nacked atomic.Bool
	runRouter(t, sub, "t", func(m *message.Message) error {
		if handled.Add(1) == 1500 && nacked.CompareAndSwap(false, true) {
			return errors.New("once")
		}
		return nil
	})
	pollUntil(t, "every message acked", time.Minute, nil, func() bool { return b.outboxRows(t, "t") == 0 })
	ev.mu.Lock()
	evs := append([]pgoutbox.Event(nil), ev.list...)
	ev.mu.Unlock()
	retried := -1
	for i, e := range evs {
		if e.Kind == pgoutbox.EventRetried {
			retried = i
			break
		}
	}
	require.GreaterOrEqual(t, retried, 0, "the nack was recorded")
	after := evs[retried:]
	held, leased := rowsClaimedOnPath(after, pgoutbox.PathHeld), rowsClaimedOnPath(after, pgoutbox.PathLease)
	t.Logf("after the nack: held %d, leased %d", held, leased)
	// Held batches take 256 rows, a lease claim up to 1,024 (the look for
	// expired leases, once a second, leases): the held path ran on after
	// the nack, four batches at least, where it was off for 10 s before.
	require.GreaterOrEqual(t, held, 4*256, "after the nack the rows were claimed held (held %d, leased %d)", held, leased)
}

// A held batch whose connection dies while its row's handler runs: the
// server rolls the transaction back and the row is due at once, so the
// subscription's next claim takes it again before the batch's end tells
// it the row is lost. That claim must not hand the row out beside the
// handler still running it: it waits until the handler answered. Once
// with a bound longer than the handler (its ack ends the batch, which
// fails), once with the handler outliving the bound and ignoring its
// context, which the lost row's end cancels. Both are keyed: the key must
// not run twice either.
func TestHeldRowClaimedAgainAfterItsBatchWasKilledWaitsForItsHandler(t *testing.T) {
	for _, tc := range []struct {
		name    string
		bound   time.Duration
		handler time.Duration
	}{
		{"handler-ends-the-batch", 10 * time.Second, 1500 * time.Millisecond},
		{"handler-outlives-the-bound", 500 * time.Millisecond, 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := context.Background()
			pool, app := heldPool(t, b, 10)
			m := newMsg("only")
			pgoutbox.WithOrderingKey(m, "k")
			b.publishInTx(t, "t", true, m)
			id := "killed-batch-" + watermill.NewShortUUID()
			testhook.SetHeldBound(id, tc.bound)
			t.Cleanup(func() { testhook.SetHeldBound(id, 0) })
			sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
				c.WorkerID = id
				onPath(t, testhook.PathHeld, c)
				c.MaxInFlight = 8
			})

			type call struct {
				start, end time.Time
				cancelled  bool
			}
			var mu sync.Mutex
			var calls []call
			running, peak := 0, 0
			started := make(chan struct{}, 8)
			runRouter(t, sub, "t", func(msg *message.Message) error {
				mu.Lock()
				running++
				peak = max(peak, running)
				calls = append(calls, call{start: time.Now()})
				n := len(calls) - 1
				mu.Unlock()
				started <- struct{}{}
				if n == 0 {
					time.Sleep(tc.handler) // the work, deaf to its context as many handlers are
				}
				mu.Lock()
				running--
				calls[n].end, calls[n].cancelled = time.Now(), msg.Context().Err() != nil
				mu.Unlock()
				return nil
			})
			select {
			case <-started:
			case <-time.After(10 * time.Second):
				t.Fatal("the message was not delivered")
			}
			var killed int
			require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 2000))
				FROM pg_stat_activity WHERE `+idleInTxOf, app).Scan(&killed))
			require.Equal(t, 1, killed, "the held batch's transaction")

			pollUntil(t, "the row delivered again", 30*time.Second, nil, func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(calls) == 2 && !calls[1].end.IsZero()
			})
			pollUntil(t, "outbox empty", 30*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
			mu.Lock()
			defer mu.Unlock()
			require.Equal(t, 1, peak, "the row ran in two handlers at once")
			require.False(t, calls[1].start.Before(calls[0].end), "the second delivery started before the first handler returned")
			if tc.bound < tc.handler {
				require.True(t, calls[0].cancelled, "the lost row's handler context was not cancelled")
			}
		})
	}
}

// The same on an ordered subscription of keyed messages: the rows of the
// killed batches come back once the first handler answered, never in
// reverse (they were let go one by one, and each went in front of the
// one before: 5 4 3 2 1; TestOwnerRowsLetGoInOneTurnGoOutInQueueOrder
// pins that order without a server).
func TestHeldRowsClaimedAgainAfterAKilledBatchNeverComeBackReversed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pool, app := heldPool(t, b, 10)
	msgs := newMsgs(6)
	for i, m := range msgs {
		pgoutbox.WithOrderingKey(m, fmt.Sprint("k", i)) // keys keep the claims going while "1" runs (into the buffer)
	}
	b.publishInTx(t, "t", true, msgs...)
	id := "killed-ordered-" + watermill.NewShortUUID()
	testhook.SetHeldBound(id, 10*time.Second)
	t.Cleanup(func() { testhook.SetHeldBound(id, 0) })
	sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.WorkerID = id
		onPath(t, testhook.PathHeld, c)
	})
	seen := &list{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("deliveries in order: %v", seen.get())
		}
	})
	started, killed := make(chan struct{}), make(chan struct{})
	runRouter(t, sub, "t", func(msg *message.Message) error {
		seen.add(string(msg.Payload))
		if string(msg.Payload) == "1" && len(seen.get()) == 2 {
			close(started)
			<-killed
			time.Sleep(time.Second) // the work: the next claims take the batch's rows again meanwhile
		}
		return nil
	})
	<-started
	pollUntil(t, "the held batch killed", 10*time.Second, nil, func() bool {
		var n int
		require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 2000))
			FROM pg_stat_activity WHERE `+idleInTxOf, app).Scan(&n))
		return n > 0
	})
	close(killed)
	// MaxInFlight is 1: the rows claimed behind "1" (each of a key of its
	// own) wait in the buffer, in batches killed with its own, and go out
	// once "1" answered. Some may go out before the owner learns that their
	// batch is gone, and come again: a replay from an earlier row, as after
	// a crash (docs/ordering.md). "1" is due again once its handler
	// answered, and may come back behind "2" when a claim took "2" first.
	// A batch claimed after the kill commits: its rows handed out before
	// the owner learned of the others' end are not delivered again, and the
	// rows of the killed batches may come back after them; each batch's
	// end is learned on its own, in any order. Each message is a key of
	// its own, so nothing orders them but the buffer (docs/delivery.md,
	// Order). So: every row comes, and a replay starts over from an
	// earlier row, but no three deliveries go out in reverse (5 4 3 2).
	pollUntil(t, "every message handled, 1 twice", 30*time.Second, nil, func() bool {
		got := seen.get()
		return len(got) > 2 && slices.Contains(got[2:], "1") && b.outboxRows(t, "t") == 0
	})
	got := seen.get()
	require.Equal(t, []string{"0", "1"}, got[:2], "the deliveries up to the handler that outlived its batch")
	rest := slices.Clone(got[2:])
	rest = slices.Delete(rest, slices.Index(rest, "1"), slices.Index(rest, "1")+1)
	distinct := slices.Compact(slices.Sorted(slices.Values(rest)))
	require.Equal(t, []string{"2", "3", "4", "5"}, distinct, "every row after 1 handled: %v", got)
	for i := 2; i < len(rest); i++ {
		require.False(t, rest[i-2] > rest[i-1] && rest[i-1] > rest[i], "three deliveries in reverse order: %v", got)
	}
}

// With MaxDeliveries, every delivery is written before its handler runs,
// on every claim mode: a handler that crashes its process must be counted,
// and a held row's delivery is written only when its batch ends. Each
// handler reads its own row's count from another connection; on the held
// path it would read 0. No claim takes the held path.
func TestMaxDeliveriesCountsEachDeliveryBeforeItsHandlerRuns(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		pool, _ := heldPool(t, b, 10)
		ev := newEvents()
		sub := b.heldSubscriber(t, pool, func(c *pgoutbox.SubscriberConfig) {
			c.ClaimMode = mode
			c.MaxInFlight = 4
			c.MaxDeliveries = 3
			c.Observer = ev
		})
		const n = 60
		b.publishInTx(t, "t", true, newMsgs(n)...)
		var mu sync.Mutex
		uncounted := map[string]int{}
		handled := map[string]bool{}
		runRouter(t, sub, "t", func(m *message.Message) error {
			var written int
			err := b.Pool.QueryRow(context.Background(), `SELECT deliveries FROM `+b.Schema+`.outbox WHERE uuid = $1`, m.UUID).Scan(&written)
			if err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			if written < 1 {
				uncounted[m.UUID] = written
			}
			handled[m.UUID] = true
			return nil
		})
		pollUntil(t, "every message handled", 20*time.Second, nil, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(handled) == n
		})
		mu.Lock()
		defer mu.Unlock()
		require.Empty(t, uncounted, "deliveries not written while their handler ran")
		require.Zero(t, rowsClaimedOnPath(ev.snapshot(), pgoutbox.PathHeld), "a claim took the held path")
	})
}
