package tests

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// A process killed while its claim runs leaves that claim to the server,
// which runs it to its end and commits it although the client is gone: the
// claim's rows are leased under the dead holder's key after its liveness
// lock vanished, possibly after the survivors' looks for its rows found
// nothing. They still come back within seconds, not at their lease's end.
// The dead process is played by hand: a connection holding a liveness
// lock, rows leased under its key, and a transaction leasing more that
// commits only after the survivor took the first ones over.
func TestOrphanedRowsOfAClaimThatCommittedAfterItsHolderDied(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, orphansOfALateClaim)
}

func orphansOfALateClaim(t *testing.T, mode pgoutbox.ClaimMode) {
	b := setup(t)
	ctx := context.Background()
	const (
		topic = "t"
		lease = 2 * time.Minute
	)
	tbl := b.Schema + ".outbox"
	b.publishInTx(t, topic, true, newMsgs(20)...)
	var ids []int64
	rows, err := b.Pool.Query(ctx, `SELECT id FROM `+tbl+` WHERE topic = $1 ORDER BY id`, topic)
	require.NoError(t, err)
	ids, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	early, late := ids[:10], ids[10:]

	// The dead process's liveness lock, and what it leased before it died.
	key := rand.Int32N(1<<30) + 1
	holder, err := pgx.Connect(ctx, b.DSN)
	require.NoError(t, err)
	defer func() { _ = holder.Close(context.Background()) }()
	var locked bool
	require.NoError(t, holder.QueryRow(ctx, query.TryLiveness, key).Scan(&locked))
	require.True(t, locked)
	leaseUnder := `UPDATE ` + tbl + ` SET lease_token = gen_random_uuid(), leased_until = now() + interval '2 minutes',
       leased_by = 'dead', lease_holder = $2, deliveries = deliveries + 1 WHERE id = ANY ($1)`
	_, err = b.Pool.Exec(ctx, leaseUnder, early, key)
	require.NoError(t, err)
	// Its last claim, still running on the server.
	lastClaim, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = lastClaim.Rollback(context.Background()) }()
	_, err = lastClaim.Exec(ctx, leaseUnder, late, key)
	require.NoError(t, err)

	// The survivor, on a pool of its own so that its liveness checks can
	// be seen in pg_stat_activity.
	app := "pgoutbox-orphans-" + b.Schema
	pool := b.namedPool(t, app)
	var lastEmptyClaim atomic.Int64 // unix nanoseconds
	sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.Observer = pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
			if e.Kind == pgoutbox.EventClaimed && e.Count == 0 {
				lastEmptyClaim.Store(time.Now().UnixNano())
			}
		})
		c.Lease = lease
		c.MaxPollInterval = 30 * time.Second // only a look for orphans or a lease's end brings the rows back
		c.ClaimMode = mode
	})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	// It must have seen the lock held, or its vanishing means nothing.
	checkRanSince(t, b, app, time.Now(), "the survivor checked liveness while the lock was held")

	require.NoError(t, holder.Close(ctx)) // the process dies
	died := time.Now()
	got := ackAll(t, msgs, len(early))
	t.Logf("the rows leased before the death back after %s", time.Since(died).Round(time.Millisecond))
	// Only now does its last claim commit, once a claim after the last
	// early row found nothing: the looks that followed the death are over
	// (a look goes on while the one before took rows).
	tookAll := time.Now()
	require.Eventually(t, func() bool { return lastEmptyClaim.Load() > tookAll.UnixNano() }, 20*time.Second, 5*time.Millisecond,
		"a claim after the early rows found nothing")
	require.NoError(t, lastClaim.Commit(ctx))
	committed := time.Now()
	for len(got) < len(ids) {
		m := receive(t, msgs, lease/4)
		got[m.UUID] = true
		m.Ack()
	}
	t.Logf("the rows of the claim that committed after the death back after %s (lease %s)", time.Since(committed).Round(time.Millisecond), lease)
	require.Less(t, time.Since(committed), lease/4, "back long before their leases end")
}

// Rows a subscription leases before its process holds its liveness lock
// (the first claims after Subscribe, while the LISTEN connection is still
// being set up) carry no holder: were the process to die, they would wait
// for their lease to expire (30s here). They are stamped at the first
// housekeeping after the lock is held, a second at most, not at the first
// renewal half a lease later.
func TestRowsLeasedBeforeTheLivenessLockAreStampedSoon(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.publishInTx(t, "t", true, newMsgs(20)...)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode = pgoutbox.ClaimLease
		c.MaxInFlight = 4
		c.Lease = 30 * time.Second
	})
	release := make(chan struct{})
	started := make(chan struct{}, 20)
	runRouter(t, sub, "t", func(m *message.Message) error {
		started <- struct{}{}
		<-release
		return nil
	})
	t.Cleanup(func() { close(release) }) // before the router's Close, which waits for the handlers
	for range 4 {
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			t.Fatal("the handlers did not start")
		}
	}
	t.Logf("leased rows without a holder at first sight: %d",
		b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE lease_token IS NOT NULL AND lease_holder IS NULL`))
	pollUntil(t, "every leased row stamped with the process's liveness key", 5*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE lease_token IS NOT NULL AND lease_holder IS NULL`) == 0 &&
			b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE lease_token IS NOT NULL`) >= 4
	})
}

// A live process whose LISTEN connection drops, and cannot come back for
// seconds, loses its liveness lock while its handlers run: other
// processes would take its leased rows for orphans a second after the
// lock went, and run them beside its handlers. It renews them without a
// holder as soon as its connection fails, so they wait for their leases:
// consumer A's LISTEN connection goes through a proxy that is cut for 3 s
// while A's four handlers run; consumer B, a process of its own, gets none
// of A's rows, and A's acks are written. On every claim mode: a held row
// whose handler outlives the bound is a lease too.
func TestRowsOfAProcessWhoseListenConnectionDropsStayItsOwn(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) { listenConnectionDrops(t, mode, (*tcpProxy).cut) })
}

// The same when A's LISTEN path goes silent instead: the server ends that
// session (and drops A's lock) while A hears nothing, neither an answer to
// its liveness check nor a reset. A stops counting on its lock when no
// check confirmed it for notifier.OwnLockValidFor, before B's checks would
// find the key gone long enough; until then A could only have learnt it
// when its check gave up, seconds after B took A's rows.
func TestRowsOfAProcessWhoseListenPathGoesSilentStayItsOwn(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) { listenConnectionDrops(t, mode, (*tcpProxy).silence) })
}

// A process whose handlers keep every connection of its pool busy cannot
// renew its rows without its key when its LISTEN path goes half-open; it
// takes its lock again on a new LISTEN connection before the others count
// the key gone, so its rows stay its own.
func TestRowsOfAProcessWithABusyPoolStayItsOwnWhenItsListenPathIsStranded(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		p := startBusyPair(t, mode, "stranded")
		stranded := time.Now()
		p.px.strand()
		pollUntil(t, "A's lock on a new LISTEN connection", 10*time.Second, nil, func() bool {
			return lockedSince(t, p.b, p.listenA, stranded)
		})
		p.end(t)
	})
}

// A path that stalls for a moment (a check answered late: the lock
// lapses, and a probe finds it held) and goes silent soon after is probed
// again: the rows of a process whose handlers hold every connection of its
// pool stay its own.
func TestRowsOfAProcessWithABusyPoolStayItsOwnWhenItsPathStallsThenGoesSilent(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		p := startBusyPair(t, mode, "stall")
		// A stall longer than a confirmation lasts: the probe it starts
		// finds the lock held (a connection of its own, gone at once).
		stalled := time.Now()
		p.px.stall(time.Second)
		pollUntil(t, "A's probe connected", 10*time.Second, nil, func() bool {
			return p.b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND backend_start > $2`, p.listenA, stalled) > 0
		})
		checkRanSince(t, p.b, p.listenA, time.Now(), "A's checks answered again")
		stranded := time.Now()
		p.px.strand()
		pollUntil(t, "A's lock on a new LISTEN connection", 10*time.Second, nil, func() bool {
			return lockedSince(t, p.b, p.listenA, stranded)
		})
		p.end(t)
	})
}

// busyPair is two processes: A, whose LISTEN connection runs through px
// and whose handlers hold four rows stamped with its key and every
// connection of its pool, and B, which saw A's lock held and reports the
// rows it takes.
type busyPair struct {
	b       *bundle
	px      *tcpProxy
	listenA string // application_name of A's LISTEN connection
	evA     *events
	tookByB chan string
	release func() // A's handlers return
	free    func() // A's pool connections are released
}

func startBusyPair(t *testing.T, mode pgoutbox.ClaimMode, name string) *busyPair {
	t.Helper()
	p := &busyPair{b: setup(t), evA: newEvents(), tookByB: make(chan string, 4)}
	p.px = startTCPProxy(t, p.b.DSN)
	appA, appB := name+"-a-"+watermill.NewShortUUID(), name+"-b-"+watermill.NewShortUUID()
	p.listenA = appA + "-listen"
	poolA := p.b.namedPool(t, appA)
	subA := p.b.subscriberOn(t, poolA, func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode, c.MaxInFlight, c.Lease = mode, 4, 30*time.Second
		c.ListenDSN = viaProxy(t, p.b.DSN, p.px.addr, p.listenA)
		c.Observer = p.evA
	})
	var stamped time.Time
	p.release, stamped = holdFourStampedRows(t, p.b, subA)
	p.free = occupyPool(t, poolA)
	subB := p.b.subscriberOn(t, p.b.namedPool(t, appB), func(c *pgoutbox.SubscriberConfig) { c.MaxInFlight = 4 })
	runRouter(t, subB, "t", func(m *message.Message) error {
		p.tookByB <- m.UUID
		return nil
	})
	checkRanSince(t, p.b, appB, stamped, "B's notifier checked the liveness locks since A held its own")
	return p
}

// end requires that B takes none of A's rows for 3 s, then lets A's
// handlers finish and requires that A's acks are written.
func (p *busyPair) end(t *testing.T) {
	t.Helper()
	requireNoString(t, p.tookByB, 3*time.Second)
	p.free()
	p.px.restore()
	p.release()
	pollUntil(t, "A's acks written", 20*time.Second, nil, func() bool { return p.b.outboxRows(t, "t") == 0 })
	require.Zero(t, p.evA.countKind(pgoutbox.EventLeaseLost), "A kept its rows")
	requireNoString(t, p.tookByB, 0)
}

// lockedSince reports whether a connection of app that started after
// since holds a liveness lock.
func lockedSince(t *testing.T, b *bundle, app string, since time.Time) bool {
	return b.count(t, `SELECT count(*) FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.objsubid = 2 AND l.granted AND a.application_name = $2 AND a.backend_start > $3`,
		query.LivenessClass, app, since) > 0
}

// occupyPool acquires every connection of pool, as handlers in long
// statements hold them, until the returned function (also run at the
// test's end) releases them.
func occupyPool(t *testing.T, pool *pgxpool.Pool) (free func()) {
	t.Helper()
	var conns []*pgxpool.Conn
	deadline := time.Now().Add(10 * time.Second)
	for pool.Stat().AcquiredConns() < pool.Config().MaxConns {
		require.True(t, time.Now().Before(deadline), "the pool's connections could not all be taken")
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		c, err := pool.Acquire(ctx)
		cancel()
		if err == nil {
			conns = append(conns, c)
		}
	}
	var once sync.Once
	free = func() {
		once.Do(func() {
			for _, c := range conns {
				c.Release()
			}
		})
	}
	t.Cleanup(free)
	return free
}

// holdFourStampedRows publishes four messages on topic "t" and runs sub's
// handlers on them until release is called (also at the test's end); it
// returns once the four rows carry sub's liveness key, with a time at
// which it held its lock.
func holdFourStampedRows(t *testing.T, b *bundle, sub *pgoutbox.Subscriber) (release func(), stamped time.Time) {
	t.Helper()
	b.publishInTx(t, "t", true, newMsgs(4)...)
	done := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(done) }) }
	started := make(chan string, 4)
	runRouter(t, sub, "t", func(m *message.Message) error {
		started <- m.UUID
		<-done
		return nil
	})
	t.Cleanup(release) // before the router's Close, which waits for the handlers
	for range 4 {
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			t.Fatal("the handlers did not start")
		}
	}
	pollUntil(t, "the rows stamped with the liveness key", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE lease_holder IS NOT NULL`) == 4
	})
	require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT now()`).Scan(&stamped))
	return release, stamped
}

func listenConnectionDrops(t *testing.T, mode pgoutbox.ClaimMode, fail func(*tcpProxy)) {
	b := setup(t)
	px := startTCPProxy(t, b.DSN)
	listen, err := url.Parse(b.DSN)
	require.NoError(t, err)
	listen.Host = px.addr
	evA := newEvents()
	subA := b.subscriberOn(t, b.namedPool(t, "lockloss-a"), func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode, c.MaxInFlight, c.Lease = mode, 4, 30*time.Second
		c.ListenDSN = listen.String()
		c.Observer = evA
	})
	release, stamped := holdFourStampedRows(t, b, subA) // A holds its lock from before stamped

	// B, another process (its own pool and LISTEN connection).
	subB := b.subscriberOn(t, b.namedPool(t, "lockloss-b"), func(c *pgoutbox.SubscriberConfig) { c.MaxInFlight = 4 })
	tookByB := make(chan string, 4)
	runRouter(t, subB, "t", func(m *message.Message) error {
		tookByB <- m.UUID
		return nil
	})
	// B takes A's rows for orphans only if its notifier saw A's lock held.
	checkRanSince(t, b, "lockloss-b", stamped, "B's notifier checked the liveness locks since A held its own")

	fail(px)
	requireNoString(t, tookByB, 3*time.Second)
	px.restore()
	release()
	pollUntil(t, "A's acks written", 20*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
	require.Zero(t, evA.countKind(pgoutbox.EventLeaseLost), "A kept its rows")
	requireNoString(t, tookByB, 0)
}

// viaProxy is the test database's DSN through the proxy at addr, with the
// application name app.
func viaProxy(t *testing.T, dsn, addr, app string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	u.Host = addr
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	return u.String()
}

// checkedSince reports whether the LISTEN connection of app ran a liveness
// check that started after since, or prepared one: see checkRanSince.
func checkedSince(t *testing.T, b *bundle, app string, since time.Time) bool {
	return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query = $2 AND query_start > $3 AND state = 'idle'`,
		app, query.LiveHoldersMine, since) > 0
}

// checkRanSince waits until the LISTEN connection of app has run a
// liveness check that started after since: run, not only prepared.
// checkedSince cannot tell the two apart: pgx prepares a statement on its
// first use in a session in a round trip of its own (Parse, Describe,
// Sync), after which pg_stat_activity shows the check's query, idle,
// started after since, although it has not run. A lock dropped then is
// missing from that first check and from every one after: the notifier
// never saw it held, so its vanishing is never reported (no Vanished, no
// Orphans, no later looks for its rows). A phase that starts after one
// was seen is that check's execution or a later check, prepared already,
// which runs in one round trip: it ran.
func checkRanSince(t *testing.T, b *bundle, app string, since time.Time, msg string) {
	t.Helper()
	for range 2 {
		require.Eventually(t, func() bool { return checkedSince(t, b, app, since) }, 10*time.Second, 10*time.Millisecond, msg)
		since = time.Now()
	}
}

// A's LISTEN path goes silent, as above, while B's own LISTEN connection
// drops and comes back right after B's checks: a new session checks at
// once, so B's checks that miss A's key come closer together than
// notifier.LivenessEvery. B must still count A's key gone only a second
// after it went, by then A has renewed its rows without it.
func TestRowsOfASilentProcessStayItsOwnWhileAnotherReconnects(t *testing.T) {
	t.Parallel()
	for _, drops := range []int{1, 3} {
		t.Run(fmt.Sprintf("drops=%d", drops), func(t *testing.T) {
			t.Parallel()
			onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) { silentWhileAnotherReconnects(t, mode, drops) })
		})
	}
}

func silentWhileAnotherReconnects(t *testing.T, mode pgoutbox.ClaimMode, drops int) {
	b := setup(t)
	pxA, pxB := startTCPProxy(t, b.DSN), startTCPProxy(t, b.DSN)
	appA, appB := "rc-a-"+watermill.NewShortUUID(), "rc-b-"+watermill.NewShortUUID()
	subA := b.subscriberOn(t, b.namedPool(t, appA+"-pool"), func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode, c.MaxInFlight, c.Lease = mode, 4, 30*time.Second
		c.ListenDSN = viaProxy(t, b.DSN, pxA.addr, appA)
	})
	release, stamped := holdFourStampedRows(t, b, subA)
	subB := b.subscriberOn(t, b.namedPool(t, appB+"-pool"), func(c *pgoutbox.SubscriberConfig) {
		c.MaxInFlight = 4
		c.ListenDSN = viaProxy(t, b.DSN, pxB.addr, appB)
	})
	tookByB := make(chan string, 4)
	runRouter(t, subB, "t", func(m *message.Message) error { tookByB <- m.UUID; return nil })
	checkRanSince(t, b, appB, stamped, "B checked while A held its lock")

	// Silence A's path right after a check confirmed A's lock: A
	// lapses the latest then.
	since := time.Now()
	pollUntil(t, "A checked its lock", 10*time.Second, nil, func() bool { return checkedSince(t, b, appA, since) })
	pxA.silence()
	last := time.Now()
	for range drops {
		pollUntil(t, "B checked since", 10*time.Second, nil, func() bool { return checkedSince(t, b, appB, last) })
		last = time.Now()
		pxB.cut()
		pxB.restore()
	}
	requireNoString(t, tookByB, 3*time.Second)
	pxA.restore()
	release()
	pollUntil(t, "A's acks written", 20*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
	requireNoString(t, tookByB, 0)
}

// A LISTEN path with a round trip of 140 ms (a server in another region)
// keeps a process's lock confirmed: its rows carry its key, so a crash
// brings them back in a second, not at their lease's end.
func TestRowsKeepTheirKeyOverASlowListenPath(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, rowsKeepTheirKeyOverASlowListenPath)
}

// A LISTEN path whose round trips all take longer than a confirmation
// lasts (300 ms) is slow, not broken: the process keeps its session and its
// lock (the probes its lapses start find it held) instead of reconnecting,
// so its key never goes missing to the other processes.
func TestSlowListenPathKeepsItsSessionAndLock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	app := "slower-listen-" + watermill.NewShortUUID()
	sub := b.subscriberOn(t, b.namedPool(t, app+"-pool"), func(c *pgoutbox.SubscriberConfig) {
		c.ListenDSN = viaProxy(t, b.DSN, startDelayProxy(t, b.DSN, 150*time.Millisecond), app)
	})
	_, err := sub.Subscribe(t.Context(), "t")
	require.NoError(t, err)
	type holder struct{ pid, key int64 }
	lockHolders := func() []holder {
		rows, err := b.Pool.Query(context.Background(), `SELECT l.pid, l.objid::bigint FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.objsubid = 2 AND l.granted AND a.application_name = $2`, query.LivenessClass, app)
		require.NoError(t, err)
		hs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (h holder, err error) { return h, r.Scan(&h.pid, &h.key) })
		require.NoError(t, err)
		return hs
	}
	var first []holder
	pollUntil(t, "the lock taken", 20*time.Second, nil, func() bool { first = lockHolders(); return len(first) == 1 })
	probes := 0
	for end := time.Now().Add(6 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		require.Equal(t, first, lockHolders(), "the lock stays with the first session")
		probes = max(probes, b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND pid <> $2`, app, first[0].pid))
	}
	require.Positive(t, probes, "the lapses were probed (connections of their own)")
}

func rowsKeepTheirKeyOverASlowListenPath(t *testing.T, mode pgoutbox.ClaimMode) {
	b := setup(t)
	sub := b.subscriberOn(t, b.namedPool(t, fmt.Sprintf("slow-listen-%v", mode)), func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode, c.MaxInFlight, c.Lease = mode, 4, 30*time.Second
		c.ListenDSN = viaProxy(t, b.DSN, startDelayProxy(t, b.DSN, 70*time.Millisecond), "slow-listen-conn")
	})
	holdFourStampedRows(t, b, sub)
	// Sample for 4 s (eight checks): the key must stay on the rows.
	keyed, samples := 0, 0
	for end := time.Now().Add(4 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		keyed += b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE lease_holder IS NOT NULL`)
		samples += 4
	}
	require.GreaterOrEqual(t, float64(keyed)/float64(samples), 0.5, "the rows carried the key %d of %d times (a lapse on a loaded machine takes it off them until the next check)", keyed, samples)
}

// Every backend of a process terminated at once (its pool's 24, all open,
// and its LISTEN connection's, as an operator's pg_terminate_backend of an
// application does): its lock goes with them, and it renews its rows
// without its key on fresh connections before the other processes count
// the key gone for long enough, so its rows stay its own while its
// handlers run.
func TestRowsOfAProcessWhoseBackendsAreAllTerminatedStayItsOwn(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		app := "terminated-a-" + mode.String()
		evA := newEvents()
		cfg, err := pgxpool.ParseConfig(b.DSN)
		require.NoError(t, err)
		cfg.ConnConfig.RuntimeParams["application_name"] = app
		cfg.MaxConns = 24 // every one of them open, and then dead
		poolA, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(poolA.Close)
		var conns []*pgxpool.Conn
		for range 24 {
			c, err := poolA.Acquire(context.Background())
			require.NoError(t, err)
			conns = append(conns, c)
		}
		for _, c := range conns {
			c.Release()
		}
		subA := b.subscriberOn(t, poolA, func(c *pgoutbox.SubscriberConfig) {
			c.ClaimMode, c.MaxInFlight, c.Lease = mode, 4, 30*time.Second
			c.Observer = evA
		})
		release, stamped := holdFourStampedRows(t, b, subA)
		subB := b.subscriberOn(t, b.namedPool(t, "terminated-b-"+mode.String()), func(c *pgoutbox.SubscriberConfig) { c.MaxInFlight = 4 })
		tookByB := make(chan string, 4)
		runRouter(t, subB, "t", func(m *message.Message) error {
			tookByB <- m.UUID
			return nil
		})
		checkRanSince(t, b, "terminated-b-"+mode.String(), stamped, "B's notifier checked the liveness locks since A held its own")

		require.Positive(t, b.count(t, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1) x`, app))
		requireNoString(t, tookByB, 3*time.Second)
		release()
		pollUntil(t, "A's acks written", 20*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
		require.Zero(t, evA.countKind(pgoutbox.EventLeaseLost), "A kept its rows")
		requireNoString(t, tookByB, 0)
	})
}
