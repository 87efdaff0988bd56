package notifier

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// A lapse is probed every time, unless probes found the lock held
// slowStreak times in a row with checks answered between them: a path that
// slow stays slow, and each probe is a new server session; probes then
// pause for probeQuiet. (A slow path that goes silent within that pause is
// found out by the session's check timing out, livenessCheckTimeout.)
const (
	slowStreak = 3
	probeQuiet = 10 * LivenessEvery
)

// lockedConn is a connection that holds the liveness lock key, taken by a
// statement sent at sent.
type lockedConn struct {
	conn *pgx.Conn
	key  int64
	sent time.Time
}

func (c *lockedConn) close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = c.conn.Close(ctx)
}

// lockProbe finds out, when a session's lock went unconfirmed for
// OwnLockValidFor, whether the server still holds it for that session, by
// trying the key on a connection of its own. Free, the session's server
// side is gone (a half-open path: the server dropped the lock, and the
// process heard nothing): the probe keeps the lock, ends the session, and
// its connection carries the next one, before the other processes count
// the key gone. The rows stamped with the key then stay this process's
// without a statement on the pool, which the handlers may all hold. Held,
// the path is slow, or the session's server side lives on while its path
// is broken: the probe closes, and probes again OwnLockValidFor later
// unless a check was answered meanwhile (the lapse timer, which only a
// confirmation arms again, would not). One probe runs at a time.
//
// Its state belongs to run, one goroutine per session: the lapse timer
// asks it for a probe (start), the attempt reports back on a channel, and
// the session takes the outcome when it ends (result).
type lockProbe struct {
	try      func(ctx context.Context, key int64) *lockedConn // tryLock with the session's settings
	answered func() time.Time                                 // when a check last confirmed the lock
	ctx      context.Context                                  // the session's
	end      context.CancelCauseFunc                          // ends the session
	now      func() time.Time                                 // time.Now; tests move it
	settled  func()                                           // tests: run saw an attempt's outcome

	lapses  chan int64       // start's requests
	stop    chan struct{}    // closed by result
	outcome chan *lockedConn // run's last word: the connection that took the lock, or nil
}

// newLockProbe starts the probe of a session; result must be called when
// the session ends. now and settled may be nil.
func newLockProbe(ctx context.Context, end context.CancelCauseFunc,
	try func(context.Context, int64) *lockedConn, answered func() time.Time,
	now func() time.Time, settled func()) *lockProbe {
	if now == nil {
		now = time.Now
	}
	if settled == nil {
		settled = func() {}
	}
	p := &lockProbe{try: try, answered: answered, ctx: ctx, end: end, now: now, settled: settled,
		lapses: make(chan int64, 1), stop: make(chan struct{}), outcome: make(chan *lockedConn, 1)}
	go p.run()
	return p
}

// start asks for a probe of key after a lapse. It never blocks: a request
// while one waits, a probe runs, probes pause (see slowStreak), the session
// ended or a probe took the lock comes to nothing.
func (p *lockProbe) start(key int64) {
	if key == 0 {
		return
	}
	select {
	case p.lapses <- key:
	default:
	}
}

// result stops the probe, waits for a running attempt and returns its
// connection if an attempt took the lock.
func (p *lockProbe) result() *lockedConn {
	close(p.stop)
	return <-p.outcome
}

// run owns the probe's state until result.
func (p *lockProbe) run() {
	var (
		attempts   = make(chan *lockedConn, 1) // the running attempt's outcome
		running    bool
		lastEnd    time.Time // when the last attempt found the lock held
		streak     int       // attempts in a row that found it held, checks answered between them
		quietUntil time.Time
		retry      *time.Timer // again OwnLockValidFor after an attempt found the lock held
		retries    <-chan time.Time
		probing    int64 // the key of the running or last attempt
	)
	launch := func(key int64) {
		running, probing = true, key
		go func() { attempts <- p.try(p.ctx, key) }()
	}
	stopRetry := func() {
		if retry != nil {
			retry.Stop()
			retry, retries = nil, nil
		}
	}
	for {
		select {
		case key := <-p.lapses:
			if !running && !p.now().Before(quietUntil) {
				launch(key)
			}
		case <-retries:
			retry, retries = nil, nil
			// No pause here: no check was answered since that attempt.
			if !running && !p.answered().After(lastEnd) {
				launch(probing)
			}
		case won := <-attempts:
			running = false
			if won != nil {
				stopRetry()
				p.settled()
				p.end(errLockMoved)
				<-p.stop
				p.outcome <- won
				return
			}
			now := p.now()
			if !lastEnd.IsZero() && p.answered().After(lastEnd) {
				streak++
			} else {
				streak = 1
			}
			if streak >= slowStreak {
				streak = 0
				quietUntil = now.Add(probeQuiet)
			}
			lastEnd = now
			stopRetry()
			retry = time.NewTimer(OwnLockValidFor)
			retries = retry.C
			p.settled()
		case <-p.stop:
			stopRetry()
			var won *lockedConn
			if running {
				won = <-attempts
			}
			p.outcome <- won
			return
		}
	}
}

// tryLock connects with cfg and takes the liveness lock key there, or
// returns nil (the connection closed) if it cannot.
func tryLock(ctx context.Context, cfg *pgx.ConnConfig, key int64) *lockedConn {
	ctx, cancel := context.WithTimeout(ctx, livenessCheckTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil
	}
	c := &lockedConn{conn: conn, key: key, sent: time.Now()}
	var ok bool
	if err := conn.QueryRow(ctx, query.TryLiveness, key).Scan(&ok); err != nil || !ok {
		c.close()
		return nil
	}
	return c
}
