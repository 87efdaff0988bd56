package tests

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// A lease claim that reached the server in time and then waited there for
// a table's lock (a CREATE INDEX holds one; here the paused groups' table
// is locked) past its deadline, its client's cancel request lost (a
// pooler behind a load balancer takes it elsewhere; an outage drops it),
// takes nothing when the lock goes. Its deadline was checked by now(),
// the time its transaction began, before the wait: it leased the message
// published meanwhile under a token nobody holds, after both give-backs
// of its rows had run (finding nothing), and the message came a Lease
// later, as its second attempt.
func TestALeaseClaimThatWaitedForALockPastItsDeadlineTakesNothing(t *testing.T) {
	t.Parallel()
	onEachLayout(t, leaseClaimWaitedForALock)
}

func leaseClaimWaitedForALock(t *testing.T, b *bundle) {
	ctx := context.Background()
	px := &tcpProxy{addr: startCancelDroppingProxy(t, b.DSN)}
	pool := px.pool(t, b, "lock-wait-"+b.Schema, nil)
	ev := newEvents()
	const lease, statementTimeout = 10 * time.Second, time.Second
	sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode, c.Lease, c.StatementTimeout, c.MaxInFlight = pgoutbox.ClaimLease, lease, statementTimeout, 1
		c.Observer = ev
	})
	msgs, err := sub.Subscribe(t.Context(), "t")
	require.NoError(t, err)
	waitEmptyClaim(t, ev)

	locker := lockClaimsOut(t, b)
	first := newMsg("first")
	b.publishInTx(t, "t", true, first) // wakes the subscriber: its claim waits for the lock
	// Until the oldest claim waiting has waited past its deadline and past
	// the second give-back of its rows (StatementTimeout and a second
	// after its bound began), well within a Lease.
	waited := `SELECT coalesce(extract(epoch FROM max(clock_timestamp() - xact_start)), 0) FROM pg_stat_activity
		WHERE wait_event_type = 'Lock' AND datname = current_database() AND application_name = 'lock-wait-` + b.Schema + `'`
	pollUntil(t, "a claim waiting for the lock past its deadline", 20*time.Second, nil, func() bool {
		var s float64
		require.NoError(t, b.Pool.QueryRow(ctx, waited).Scan(&s))
		return s >= (statementTimeout + 2500*time.Millisecond).Seconds()
	})
	released := time.Now()
	require.NoError(t, locker.Commit(ctx))
	b.publishInTx(t, "t", true, newMsg("second"))

	m := receive(t, msgs, 3*lease)
	took := time.Since(released)
	d, _ := pgoutbox.DeliveryOf(m)
	m.Ack()
	require.Equal(t, "first", string(m.Payload), "an ordered subscription hands out the first message first")
	require.Equal(t, 1, d.Attempt, "no delivery is counted for a claim nobody saw")
	require.Less(t, took, lease/2, "the first message waited for a lease a claim took under a token nobody holds")
	m = receive(t, msgs, 3*lease)
	m.Ack()
	require.Equal(t, "second", string(m.Payload))
}

// startCancelDroppingProxy forwards connections to dsn's server, except a
// CancelRequest, which it drops: a client's cancel never reaches the
// server, as when a pooler behind a load balancer takes it to another
// instance. It returns its address.
func startCancelDroppingProxy(t *testing.T, dsn string) string {
	return serveProxy(t, dsn, func(c, up net.Conn) {
		go func() {
			defer func() { _ = up.Close() }()
			var head [8]byte
			if _, err := io.ReadFull(c, head[:]); err != nil {
				_ = c.Close()
				return
			}
			if binary.BigEndian.Uint32(head[4:]) == 80877102 { // CancelRequest
				_ = c.Close()
				return
			}
			if _, err := up.Write(head[:]); err != nil {
				return
			}
			_, _ = io.Copy(up, c)
		}()
		go func() {
			defer func() { _ = c.Close() }()
			_, _ = io.Copy(c, up)
		}()
	})
}

// A claim that fails while it waits in the server for a lock: its
// connection terminated (its outcome unknown to the subscriber: its rows
// are given back, and once more when its deadline has passed) or the
// statement cancelled by the server (an ERROR: it rolled back, and
// nothing is given back). Neither holds anything up: a Close with nothing
// to write returns at once, saying nothing failed, and with MaxDeliveries
// a nacked message's retry, which runs alone, goes out at once. Both
// waited for the second give-back (StatementTimeout and a second), and
// Close then logged that no write completed.
func TestAClaimThatFailedInTheServerHoldsNothingUp(t *testing.T) {
	t.Parallel()
	for _, fn := range []string{"pg_terminate_backend", "pg_cancel_backend"} {
		t.Run(fn, func(t *testing.T) {
			t.Parallel()
			t.Run("close", func(t *testing.T) { t.Parallel(); closeAfterAFailedClaim(t, fn) })
			t.Run("retry alone", func(t *testing.T) { t.Parallel(); retryAloneAfterAFailedClaim(t, fn) })
		})
	}
}

// failClaimInTheServer makes the subscription's next claim wait for a
// lock, ends it with fn (pg_terminate_backend or pg_cancel_backend) and
// lets the lock go. publish wakes the subscription.
func failClaimInTheServer(t *testing.T, b *bundle, app, fn string, publish func()) {
	ctx := context.Background()
	locker := lockClaimsOut(t, b)
	publish()
	var pid int
	pollUntil(t, "the claim waits for the lock", 10*time.Second, nil, func() bool {
		return b.Pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = $1`, app).Scan(&pid) == nil
	})
	var ok bool
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT `+fn+`($1)`, pid).Scan(&ok))
	require.True(t, ok)
	require.NoError(t, locker.Commit(ctx))
}

func closeAfterAFailedClaim(t *testing.T, fn string) {
	b := setup(t)
	app := "failed-claim-" + b.Schema
	logs := &logCapture{}
	b.logger = logs
	ev := newEvents()
	sub := b.subscriberOn(t, b.namedPool(t, app), func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode, c.Lease, c.StatementTimeout, c.MaxInFlight = pgoutbox.ClaimLease, 20*time.Second, 4*time.Second, 1
		c.Observer = ev
	})
	msgs, err := sub.Subscribe(t.Context(), "t")
	require.NoError(t, err)
	waitEmptyClaim(t, ev)
	failClaimInTheServer(t, b, app, fn, func() { b.publishInTx(t, "t", true, newMsg("first")) })
	receive(t, msgs, 10*time.Second).Ack()
	ev.wait(t, pgoutbox.EventAcked, 5*time.Second)

	start := time.Now()
	require.NoError(t, sub.Close())
	require.Less(t, time.Since(start), 2*time.Second, "Close with nothing to write waited for a failed claim's second give-back")
	require.Empty(t, logs.find("error", func(e logEntry) bool { return strings.Contains(e.msg, "Giving up") }))
}

func retryAloneAfterAFailedClaim(t *testing.T, fn string) {
	b := setup(t)
	app := "failed-claim-" + b.Schema
	ev := newEvents()
	sub := b.subscriberOn(t, b.namedPool(t, app), func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode, c.Lease, c.StatementTimeout, c.MaxInFlight, c.MaxDeliveries = pgoutbox.ClaimLease, 20*time.Second, 4*time.Second, 4, 3
		c.Observer = ev
	})
	msgs, err := sub.Subscribe(t.Context(), "t")
	require.NoError(t, err)
	waitEmptyClaim(t, ev)
	failClaimInTheServer(t, b, app, fn, func() { b.publishInTx(t, "t", true, newMsg("a")) })
	m := receive(t, msgs, 10*time.Second)
	m.Nack()
	nacked := time.Now()
	for {
		m = receive(t, msgs, 10*time.Second)
		m.Ack()
		if string(m.Payload) == "a" {
			break
		}
	}
	require.Less(t, time.Since(nacked), 2*time.Second, "the retry, which runs alone, waited for a failed claim's second give-back")
}

// lockClaimsOut locks the paused groups' table, which every claim reads
// and nothing else a subscriber writes (publishes, releases, acks) does,
// in a transaction it returns: claims wait for it until it ends.
func lockClaimsOut(t *testing.T, b *bundle) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	locker, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = locker.Rollback(context.Background()) })
	_, err = locker.Exec(ctx, `LOCK TABLE `+b.Schema+`.outbox_paused IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	return locker
}

// A lease claim whose scans ran past its deadline (a backlog of rows held
// back by their ordering key, walked row by row; a busy server or a cold
// cache do the same), its client's cancel request lost, takes nothing. Its
// deadline was checked once, before its scans (a one-time filter): it
// leased the message ahead of the backlog long after its client gave up
// and after both give-backs of its rows had run, under a token nobody
// holds, and the message came a Lease later, as its second attempt. The
// claim's last statement checks the deadline again.
func TestALeaseClaimWhoseScanRanPastItsDeadlineTakesNothing(t *testing.T) {
	t.Parallel()
	onEachLayout(t, func(t *testing.T, b *bundle) {
		ctx := context.Background()
		b.publishInTx(t, "t", true, newMsg("A"))
		// Key k's oldest row is leased elsewhere for an hour: the rows of k
		// behind it are held back, and a claim without a window walks them.
		_, err := b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, deliveries, lease_token, leased_until, leased_by, ordering_key)
			VALUES ('t', gen_random_uuid()::text, 'held', 1, gen_random_uuid(), now() + interval '1 hour', 'elsewhere', 'k')`)
		require.NoError(t, err)
		_, err = b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, ordering_key)
			SELECT 't', gen_random_uuid()::text, 'x', 'k' FROM generate_series(1, 80000)`)
		require.NoError(t, err)
		_, err = b.Pool.Exec(ctx, `ANALYZE `+b.Schema+`.outbox`)
		require.NoError(t, err)

		px := &tcpProxy{addr: startCancelDroppingProxy(t, b.DSN)}
		pool := px.pool(t, b, "slow-scan-"+b.Schema, nil)
		const lease = time.Minute
		sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
			c.ClaimMode, c.Lease, c.StatementTimeout, c.MaxInFlight = pgoutbox.ClaimLease, lease, 300*time.Millisecond, 10
		})
		msgs, err := sub.Subscribe(t.Context(), "t")
		require.NoError(t, err)
		m := receive(t, msgs, lease+30*time.Second)
		m.Ack()
		require.Equal(t, "A", string(m.Payload))
		d, ok := pgoutbox.DeliveryOf(m)
		require.True(t, ok)
		require.Equal(t, 1, d.Attempt, "a claim past its deadline leased it under a token nobody holds, and it came when that lease ended")
	})
}
