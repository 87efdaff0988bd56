// Package notifier keeps one LISTEN connection per connection pool and fans
// notifications out to the subscriptions that wait for them.
//
// Sharing it per pool (instead of one per Subscriber) matters in practice:
// a CQRS processor builds one Subscriber per handler, and each LISTEN
// connection is a server backend that is not in the pool's budget.
//
// The same connection carries the process's liveness: a session advisory
// lock (query.LivenessClass, key) held while it is up. Subscriptions stamp
// the rows they lease with the key; the server drops the lock the moment the
// connection ends, so when a process dies its rows are known to be orphaned
// at once, not when their leases expire. The notifier also watches the
// other processes' locks and wakes its subscriptions when one vanishes.
package notifier

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/logbudget"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

var (
	registryMu sync.Mutex
	registry   = map[registryKey]*Notifier{}
)

// registryKey identifies a shared notifier: its pool and, when set, the
// connection string of its LISTEN connection.
type registryKey struct {
	pool   *pgxpool.Pool
	listen string
}

// Notifier owns the LISTEN connection of one pool.
type Notifier struct {
	key    registryKey
	pool   *pgxpool.Pool
	listen *pgx.ConnConfig // nil: the pool's settings
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	refs    int
	waiters map[string]map[string]map[*Waiter]struct{} // channel -> topic -> waiters
	changed chan struct{}                              // the channel set changed: LISTEN again
	cancel  context.CancelFunc
	done    chan struct{}

	// liveness is key<<1 | held, in one word so a reader never pairs a key
	// with another key's state. The key is 0 until a session took a lock.
	liveness atomic.Int64
	// confirmedUntil (unix nanoseconds) is when this process stops counting
	// its lock as held unless a check confirms it again: OwnLockValidFor
	// after the last confirming check was sent. Only the session goroutine
	// writes it.
	confirmedUntil atomic.Int64
	// shownFrom (unix nanoseconds) is when the other processes have seen
	// the lock since it was last taken or confirmed after a lapse
	// (KeyShownAfter): rows carry the key only from then on. Only the
	// session goroutine writes it.
	shownFrom atomic.Int64
	// answeredAt (unix nanoseconds) is when the last confirming check
	// answered: a lock probe tells a slow path (late answers) from a
	// silent one by it. Only the session goroutine writes it.
	answeredAt atomic.Int64

	// Only the session goroutine writes these (under mu: Spare reads).
	ownKeys map[int64]bool // every key this notifier held: never orphans
	checks  lockChecks     // the other processes' keys, held and missing

	proxyLogged bool // said once that the LISTEN connection is pooled; the session goroutine's
}

// LivenessEvery is the period of the liveness checks, from the sending of
// one to the sending of the next.
const LivenessEvery = 500 * time.Millisecond

// OrphanGrace is how long a key must stay missing from the checks
// (counted from the end of the first check that missed it, which is after
// the lock went), and be missing at the claim, before its rows count as
// orphaned: a live process whose LISTEN connection blipped takes its lock
// again within one backoff (100ms), and one whose path went silent stops
// counting on its lock (OwnLockValidFor) before then. A dead process's
// rows are reclaimed between OrphanGrace and OrphanGrace + LivenessEvery
// after its death.
const OrphanGrace = 2 * LivenessEvery

// OwnLockValidFor is how long after a check that confirmed this process's
// own lock was sent the process counts it as held without another
// confirmation: above LivenessEvery, so that a check answered within
// OwnLockValidFor - LivenessEvery (250 ms) keeps it held, and below
// OrphanGrace, so that a process whose path went silent renews its rows
// without its key before the others take them, with 250 ms for that
// write. The case: a half-open connection, where the server closed its end
// (and dropped the lock) while the process hears nothing.
const OwnLockValidFor = 750 * time.Millisecond

// KeyShownAfter is how long after this process took its lock (or had it
// confirmed after a lapse) rows are stamped with its key: by then every
// other process sent a check (LivenessEvery apart) that found it held,
// with 250 ms for its round trip. Before, another process may still count
// the key as missing since before it was taken: a lock that came back
// between two of its checks and went again (a path that keeps cutting the
// connection) left rows stamped in between to be taken as orphans while
// their holder ran them. A row claimed meanwhile carries no key, and gets
// it at the subscription's next look once the key shows.
const KeyShownAfter = 750 * time.Millisecond

// ReconnectEvery is the longest pause between two attempts to make the
// LISTEN connection again (from 100ms, growing, ±50%): when the server is
// back after an outage, wake-ups and liveness resume within about it. A
// failed attempt costs the server a refused or short-lived connection.
const ReconnectEvery = 2 * time.Second

// Waiter receives a wake-up (a value on C, never blocking the notifier)
// when rows of its topic became due, and after every (re)connect, since
// notifications sent while nobody listened are lost; when rows of its topic
// were published for later; and when another process's liveness lock
// vanished (its rows may be orphaned). Take tells which, since the last
// Take.
type Waiter struct {
	C       chan struct{}
	kinds   atomic.Uint32
	n       *Notifier
	channel string
	topic   string
	group   string
}

// Kinds are the reasons of the wake-ups since the last Take: rows
// published due now, rows scheduled for later (by a publisher, or returned
// by a subscriber with a delay), rows a subscriber returned due now, a
// liveness lock that stayed gone for OrphanGrace (its holder's leased rows
// are orphans), and one missing at the last check (Vanished: its holder
// may have died, and the rows of its held transactions are due again); and
// LockChanged: this process's own liveness lock is gone (its LISTEN
// connection dropped), was not confirmed within OwnLockValidFor (the rows
// stamped with it may soon look orphaned to other processes), or is held
// again after either (the rows can carry it again); Connected: the LISTEN
// connection was made (again), so the server answers: statements that
// failed in an outage need not wait out their backoff.
type Kinds struct {
	Due, Scheduled, Released, Orphans, Vanished, LockChanged, Connected bool
	// Arrived: a publisher's messages arrived in the arrivals table (Due
	// is set too).
	Arrived bool
}

// Take returns the reasons of the wake-ups received since the last Take,
// and clears them.
func (w *Waiter) Take() Kinds {
	k := w.kinds.Swap(0)
	return Kinds{Due: k&(1<<wakeDue|1<<wakeArrived) != 0, Scheduled: k&(1<<wakeScheduled) != 0,
		Released: k&(1<<wakeReleased) != 0, Orphans: k&(1<<wakeOrphans) != 0, Vanished: k&(1<<wakeVanished) != 0,
		LockChanged: k&(1<<wakeLockChanged) != 0, Connected: k&(1<<wakeConnected) != 0, Arrived: k&(1<<wakeArrived) != 0}
}

// Acquire returns the pool's notifier, starting it on first use. Every
// Acquire must be paired with a Release.
func Acquire(pool *pgxpool.Pool, logger watermill.LoggerAdapter) *Notifier {
	return AcquireListen(pool, nil, logger)
}

// AcquireListen is Acquire with the LISTEN connection made with listen
// instead of the pool's settings (nil: the pool's): a direct connection
// where the pool goes through a pooler in transaction mode, on which
// LISTEN and session locks do not work. Notifiers are shared per pool and
// listen settings.
func AcquireListen(pool *pgxpool.Pool, listen *pgx.ConnConfig, logger watermill.LoggerAdapter) *Notifier {
	registryMu.Lock()
	defer registryMu.Unlock()
	key := registryKey{pool: pool}
	if listen != nil {
		key.listen = listen.ConnString()
	}
	n := registry[key]
	if n == nil {
		ctx, cancel := context.WithCancel(context.Background())
		n = &Notifier{
			key:     key,
			listen:  listen,
			pool:    pool,
			logger:  logger.With(watermill.LogFields{"component": "pgoutbox_notifier"}),
			waiters: map[string]map[string]map[*Waiter]struct{}{},
			ownKeys: map[int64]bool{},
			changed: make(chan struct{}, 1),
			cancel:  cancel,
			done:    make(chan struct{}),
		}
		registry[key] = n
		go n.run(ctx)
	}
	n.refs++
	return n
}

// Release drops one reference; the last one stops the LISTEN connection.
func (n *Notifier) Release() {
	registryMu.Lock()
	n.refs--
	last := n.refs == 0
	if last {
		delete(registry, n.key)
	}
	registryMu.Unlock()
	if last {
		n.cancel()
		<-n.done
	}
}

// Listen registers a waiter for topic and consumer group on channel.
func (n *Notifier) Listen(channel, topic, group string) *Waiter {
	w := &Waiter{C: make(chan struct{}, 1), n: n, channel: channel, topic: topic, group: group}
	n.mu.Lock()
	byTopic := n.waiters[channel]
	newChannel := byTopic == nil
	if newChannel {
		byTopic = map[string]map[*Waiter]struct{}{}
		n.waiters[channel] = byTopic
	}
	if byTopic[topic] == nil {
		byTopic[topic] = map[*Waiter]struct{}{}
	}
	byTopic[topic][w] = struct{}{}
	n.mu.Unlock()
	if newChannel {
		select {
		case n.changed <- struct{}{}:
		default:
		}
	}
	return w
}

// Stop unregisters the waiter. The channel stays LISTENed until the
// notifier stops: unlistening buys nothing and would race new waiters.
func (w *Waiter) Stop() {
	w.n.mu.Lock()
	defer w.n.mu.Unlock()
	if byTopic := w.n.waiters[w.channel]; byTopic != nil {
		delete(byTopic[w.topic], w)
		if len(byTopic[w.topic]) == 0 {
			delete(byTopic, w.topic)
		}
	}
}

// Liveness returns this process's liveness key, and whether rows may
// carry it right now: its lock was held at the last check, that check
// confirmed it less than OwnLockValidFor ago, and the others have seen it
// since it was taken (KeyShownAfter). The key is 0 before the first
// session took a lock.
func (n *Notifier) Liveness() (key int64, live bool) {
	key, held := n.lockHeld()
	return key, held && time.Now().UnixNano() >= n.shownFrom.Load()
}

// lockHeld is Liveness without KeyShownAfter: whether the lock is held.
func (n *Notifier) lockHeld() (key int64, held bool) {
	v := n.liveness.Load()
	return v >> 1, v&1 == 1 && time.Now().UnixNano() < n.confirmedUntil.Load()
}

// confirmed records that a statement sent at sent found this process's
// lock, key, held, and schedules the wake-up that tells the subscriptions
// when that confirmation runs out without another. When the lock was not
// held before (just taken, or confirmed again after a lapse), rows carry
// the key from KeyShownAfter on, and the subscriptions are woken then:
// their rows get it back at once, not at their next look.
func (n *Notifier) confirmed(key int64, sent time.Time, lapse *time.Timer) {
	_, was := n.lockHeld()
	n.setLiveness(key, true)
	n.confirmedUntil.Store(sent.Add(OwnLockValidFor).UnixNano())
	n.answeredAt.Store(time.Now().UnixNano())
	lapse.Reset(time.Until(sent.Add(OwnLockValidFor)))
	if !was {
		n.shownFrom.Store(time.Now().Add(KeyShownAfter).UnixNano())
		time.AfterFunc(KeyShownAfter, func() { n.wakeAll(wakeLockChanged) })
	}
}

// lapsed wakes the subscriptions when the lock's last confirmation ran
// out: they renew their rows without the key, before the other processes'
// checks could count it gone. It reports whether the lock lapsed (false:
// it was confirmed again meanwhile).
func (n *Notifier) lapsed() bool {
	if time.Now().UnixNano() < n.confirmedUntil.Load() {
		return false
	}
	if key, _ := n.Liveness(); key != 0 {
		n.logger.Debug("The liveness lock was not confirmed in time; rows are renewed without its key until it is", watermill.LogFields{"key": key})
		n.wakeAll(wakeLockChanged)
	}
	return true
}

// errLockMoved ends a session whose lock a probe found free and took on a
// connection of its own (lockProbe): the next session runs on that one.
var errLockMoved = errors.New("the LISTEN connection's server session was gone: its liveness lock was free")

func (n *Notifier) setLiveness(key int64, live bool) {
	v := key << 1
	if live {
		v |= 1
	}
	n.liveness.Store(v)
}

// Spare returns the liveness keys whose rows must not count as orphaned
// although their lock may not be held at this instant: this process's own
// keys, the keys held at the last check, and those missing for less than
// OrphanGrace. A row stamped with any other key whose lock is not held is
// orphaned (query.Claim). ok is false until the checks have watched the
// locks for OrphanGrace.
func (n *Notifier) Spare() (keys []int64, ok bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.checks.spare(time.Now(), n.ownKeys)
}

// Liveness is the Liveness of the waiter's notifier.
func (w *Waiter) Liveness() (key int64, live bool) { return w.n.Liveness() }

// Spare is the Spare of the waiter's notifier.
func (w *Waiter) Spare() ([]int64, bool) { return w.n.Spare() }

type wakeKind int

const (
	wakeDue wakeKind = iota
	wakeScheduled
	wakeReleased
	wakeOrphans
	wakeVanished
	wakeLockChanged
	wakeConnected
	wakeArrived
)

// wake wakes the waiters ws; with onlyGroup, only those of group.
func wake(ws map[*Waiter]struct{}, kind wakeKind, onlyGroup bool, group string) {
	for w := range ws {
		if onlyGroup && w.group != group {
			continue
		}
		w.kinds.Or(1 << kind)
		select {
		case w.C <- struct{}{}:
		default:
		}
	}
}

// dispatch routes one notification; see query.Publish and query.Complete
// for the payloads: topic (rows due), ScheduleMark topic (rows due later),
// ArrivalMark topic (arrivals, due now), each possibly followed by
// GroupMark group (rows of that group only), and GroupMark topic GroupMark
// group (a subscriber returned rows due now).
func (n *Notifier) dispatch(channel, payload string) {
	kind := wakeDue
	if rest, ok := strings.CutPrefix(payload, query.ScheduleMark); ok {
		kind, payload = wakeScheduled, rest
	} else if rest, ok := strings.CutPrefix(payload, query.ArrivalMark); ok {
		kind, payload = wakeArrived, rest
	} else if rest, ok := strings.CutPrefix(payload, query.GroupMark); ok {
		kind, payload = wakeReleased, rest
	}
	topic, group, onlyGroup := strings.Cut(payload, query.GroupMark)
	n.mu.Lock()
	defer n.mu.Unlock()
	wake(n.waiters[channel][topic], kind, onlyGroup, group)
}

func (n *Notifier) wakeAll(kind wakeKind) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, byTopic := range n.waiters {
		for _, ws := range byTopic {
			wake(ws, kind, false, "")
		}
	}
}

func (n *Notifier) channels() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]string, 0, len(n.waiters))
	for ch := range n.waiters {
		out = append(out, ch)
	}
	return out
}

func (n *Notifier) run(ctx context.Context) {
	defer close(n.done)
	// Options, not fields: NewExponentialBackOff resets itself, so fields
	// set afterwards would only apply after the next Reset.
	// At most ReconnectEvery apart: an outage's end is noticed within it.
	bo := backoff.NewExponentialBackOff(backoff.WithInitialInterval(100*time.Millisecond),
		backoff.WithMaxInterval(ReconnectEvery), backoff.WithMaxElapsedTime(0))
	failures := 0
	var adopt *lockedConn
	// Outages logged as errors: a few a window, so that a connection
	// killed again and again does not log two lines each time.
	var budget logbudget.Budget
	quiet := false
	for ctx.Err() == nil {
		var err error
		adopt, err = n.session(ctx, func() {
			if failures > 0 && !quiet {
				// Its failure was an ERROR: say at the same level of
				// attention that it is over.
				n.logger.Info("LISTEN connection is back; wake-ups resume", watermill.LogFields{"failed_attempts": failures})
			}
			bo.Reset()
			failures = 0
		}, adopt)
		if ctx.Err() != nil {
			if adopt != nil {
				adopt.close()
			}
			return
		}
		if adopt != nil {
			// At once: the probe's connection holds the lock already, and
			// the sooner it listens the fewer notifications are lost.
			n.logger.Info("The LISTEN connection went silent and its server session was gone; a new connection holds the liveness lock", nil)
			continue
		}
		failures++
		if failures == 1 {
			quiet = !budget.Take(time.Now())
		}
		if failures == 1 && !quiet {
			n.logger.Error("LISTEN connection failed; fetch loops fall back to polling until it is back", err, nil)
		} else {
			n.logger.Debug("LISTEN reconnect failed", watermill.LogFields{"err": err.Error()})
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(bo.NextBackOff()):
		}
	}
}

// lockLiveness takes this process's liveness lock on conn, with the key of
// earlier sessions if it is free (rows stamped with it stay ours), else a
// new random one. At a session's start (waitForEarlier) the earlier key is
// tried earlierKeyTries times, earlierKeyPause apart: the session that
// held it may be ending on the server still.
func (n *Notifier) lockLiveness(ctx context.Context, conn *pgx.Conn, lapse *time.Timer, waitForEarlier bool) error {
	key, _ := n.Liveness()
	earlier := key
	for i := range 10 {
		switch {
		case key == 0:
			key = 1 + rand.Int64N(1<<31-2)
		case i > 0:
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(earlierKeyPause):
			}
		}
		var ok bool
		sent := time.Now()
		if err := conn.QueryRow(ctx, query.TryLiveness, key).Scan(&ok); err != nil {
			return err
		}
		if ok {
			n.mu.Lock()
			n.ownKeys[key] = true
			n.mu.Unlock()
			n.confirmed(key, sent, lapse)
			return nil
		}
		if key != earlier || i+1 >= earlierKeyTries || !waitForEarlier {
			key = 0 // another session holds it
		}
	}
	n.logger.Info("No liveness key could be locked; rows of this process are reclaimed only when their leases expire", nil)
	return nil
}

// How often, and how far apart, a new session tries the key an earlier
// session held before it takes a new one: about 150 ms for the old
// session's end to reach the server.
const (
	earlierKeyTries = 4
	earlierKeyPause = 50 * time.Millisecond
)

// livenessCheckTimeout bounds one check of the liveness locks: far above
// what the query takes on a loaded server, far below how long a silent
// connection's server side takes to die (its TCP keepalive).
const livenessCheckTimeout = 5 * time.Second

// checkLiveness reads the held liveness locks. It confirms this process
// still holds its own on this very server connection (behind a pooler it
// may not: then it takes it again, and claims stamp nothing meanwhile), and
// wakes the subscriptions to reclaim orphaned rows when a key stayed
// missing for OrphanGrace (see Spare).
func (n *Notifier) checkLiveness(ctx context.Context, conn *pgx.Conn, lapse *time.Timer, proxied bool) error {
	// Bounded: on a path gone silent the check would wait for ever, and
	// the session would never end to say that the lock may be lost.
	ctx, cancel := context.WithTimeout(ctx, livenessCheckTimeout)
	defer cancel()
	sent := time.Now()
	rows, err := conn.Query(ctx, query.LiveHoldersMine)
	if err != nil {
		return err
	}
	held := map[int64]bool{} // every key held, by any session
	mine := map[int64]bool{} // held by this session
	var k int64
	var byUs bool
	if _, err := pgx.ForEachRow(rows, []any{&k, &byUs}, func() error {
		held[k] = true
		mine[k] = mine[k] || byUs
		return nil
	}); err != nil {
		return err
	}
	ended := time.Now()
	key, _ := n.Liveness()
	switch {
	case key != 0 && proxied:
		// A key of an earlier, direct session (a DSN of several hosts, one
		// of them a pooler): not taken again here, see behindProxy.
		n.setLiveness(0, false)
		n.wakeAll(wakeLockChanged)
	case key != 0 && !mine[key]:
		n.setLiveness(key, false)
		n.wakeAll(wakeLockChanged)
		if err := n.lockLiveness(ctx, conn, lapse, false); err != nil {
			return err
		}
	case key != 0:
		n.confirmed(key, sent, lapse)
	}

	n.mu.Lock()
	gone, vanished := n.checks.add(ended, held, n.ownKeys)
	n.mu.Unlock()
	if gone {
		n.wakeAll(wakeOrphans)
	}
	if vanished {
		n.wakeAll(wakeVanished)
	}
	return nil
}

// session runs one LISTEN connection until it fails or ctx ends: adopt's
// when given (a probe's, which holds the lock already), else a new one. It
// returns the connection of a probe that found the lock free, for the
// next session.
func (n *Notifier) session(parent context.Context, connected func(), adopt *lockedConn) (next *lockedConn, err error) {
	cfg := n.pool.Config().ConnConfig.Copy()
	if n.listen != nil {
		cfg = n.listen.Copy()
	}
	// The wait for notifications is interrupted every LivenessEvery: by a
	// deadline on the socket, not by a cancel request (a new connection
	// each time), whatever the pool's connections use.
	cfg.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: c.Conn()}
	}
	var conn *pgx.Conn
	if adopt != nil {
		conn = adopt.conn
	} else {
		connectCtx, cancel := context.WithTimeout(parent, 10*time.Second)
		conn, err = pgx.ConnectConfig(connectCtx, cfg)
		cancel()
		if err != nil {
			return nil, err
		}
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	ctx, endSession := context.WithCancelCause(parent)
	probe := newLockProbe(ctx, endSession,
		func(ctx context.Context, key int64) *lockedConn { return tryLock(ctx, cfg, key) },
		func() time.Time { return time.Unix(0, n.answeredAt.Load()) }, nil, nil)
	defer func() {
		endSession(nil)
		next = probe.result()
	}()

	proxied, err := behindProxy(ctx, conn)
	if err != nil {
		return nil, err
	}
	listening := map[string]bool{}
	listenAll := func() error {
		if proxied {
			// Through a pooler a LISTEN stays on whichever server
			// connection ran it, past this process's use of it: other
			// clients of the pooler got the outbox's notifications, and
			// the pooler warned of each. In transaction pooling none
			// reached this connection anyway; polling delivers.
			return nil
		}
		for _, ch := range n.channels() {
			if listening[ch] {
				continue
			}
			if err := bounded(ctx, func(ctx context.Context) error {
				_, err := conn.Exec(ctx, "LISTEN "+query.Quote(ch))
				return err
			}); err != nil {
				return err
			}
			listening[ch] = true
		}
		return nil
	}
	if err := listenAll(); err != nil {
		return nil, err
	}
	if proxied && !n.proxyLogged {
		n.proxyLogged = true
		advice := "set SubscriberConfig.ListenDSN to a direct connection for crash detection and wake-ups"
		if n.listen != nil {
			// The user set ListenDSN, and it reaches the pooler too.
			advice = "SubscriberConfig.ListenDSN reaches the pooler as well: point it at the PostgreSQL server itself " +
				"(its host and port, not the pooler's) for crash detection and wake-ups"
		}
		n.logger.Info("The LISTEN connection goes through a connection pooler (PgBouncer): this process takes no liveness lock and listens for no wake-ups, "+
			"so the rows of a crashed process come back when their leases expire, and polling delivers; "+
			advice, nil)
	}
	// A confirmation that does not come in time may be a half-open path:
	// the probe finds out, and moves the session to its connection if the
	// server dropped the lock.
	lapse := time.AfterFunc(time.Hour, func() {
		if n.lapsed() {
			key, _ := n.Liveness()
			probe.start(key)
		}
	})
	lapse.Stop()
	switch {
	case proxied: // no lock: see behindProxy
	case adopt != nil:
		n.mu.Lock()
		n.ownKeys[adopt.key] = true
		n.mu.Unlock()
		n.confirmed(adopt.key, adopt.sent, lapse)
	default:
		if err := bounded(ctx, func(ctx context.Context) error { return n.lockLiveness(ctx, conn, lapse, true) }); err != nil {
			lapse.Stop()
			return nil, err
		}
	}
	defer func() {
		lapse.Stop()
		key, _ := n.Liveness()
		n.setLiveness(key, false)
		n.wakeAll(wakeLockChanged)
	}()
	connected()
	// Anything notified while we were not listening is lost: have every
	// loop poll once now instead of waiting out its idle interval, or the
	// backoff of a claim that failed while the server was away.
	n.wakeAll(wakeDue)
	n.wakeAll(wakeConnected)

	// Checks are sent LivenessEvery apart, however long each takes: a
	// confirmation of this process's lock then lapses only when one round
	// trip takes over OwnLockValidFor - LivenessEvery.
	checked := time.Time{}
	for {
		if time.Since(checked) >= LivenessEvery {
			checked = time.Now()
			if err := n.checkLiveness(ctx, conn, lapse, proxied); err != nil {
				return nil, err
			}
		}
		waitCtx, stopWait := context.WithTimeout(ctx, LivenessEvery-time.Since(checked))
		watcherDone := make(chan struct{})
		go func() {
			defer close(watcherDone)
			select {
			case <-n.changed:
				stopWait()
			case <-waitCtx.Done():
			}
		}()
		note, err := conn.WaitForNotification(waitCtx)
		interrupted := waitCtx.Err() != nil
		stopWait()
		// The watcher may still take the "changed" signal after the wait
		// ended: let it finish first, so listenAll below sees the channel
		// that signal announced (it is registered before it is signalled).
		<-watcherDone
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		if note != nil {
			n.dispatch(note.Channel, note.Payload)
		}
		if err != nil && !interrupted {
			return nil, err
		}
		if conn.IsClosed() {
			return nil, errors.New("LISTEN connection closed")
		}
		// Every turn, not only after an interruption: the signal that a
		// channel was added may have been consumed by a wait that a
		// notification ended first. Without a new channel this costs
		// nothing.
		if err := listenAll(); err != nil {
			return nil, err
		}
	}
}

// behindProxy reports whether conn reaches the server through a
// connection pooler (PgBouncer, in any pool mode): the backend process id
// the server reports differs from the one conn was given at connect, which
// the pooler makes up (a plain TCP proxy passes the server's on). Such a
// connection takes no liveness lock: in transaction mode its statements
// run on whichever server connection is free, so the lock would stay on
// the one that took it, held after this process dies (the pooler keeps
// that connection) and taken again, and left behind, each time the
// statements moved. Its rows then carry no key.
func behindProxy(ctx context.Context, conn *pgx.Conn) (bool, error) {
	var pid int64
	err := bounded(ctx, func(ctx context.Context) error {
		return conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid)
	})
	return err == nil && Pooled(pid, conn.PgConn()), err
}

// Pooled reports whether c reaches its server through a connection pooler:
// serverPID, what pg_backend_pid() returned on c, differs from the backend
// process id c was given at connect, which a pooler makes up (see
// behindProxy).
func Pooled(serverPID int64, c *pgconn.PgConn) bool { return serverPID != int64(c.PID()) }

// bounded runs f with ctx bounded by livenessCheckTimeout: a statement of
// the LISTEN connection on a path gone silent would wait for ever.
func bounded(ctx context.Context, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, livenessCheckTimeout)
	defer cancel()
	return f(ctx)
}
