package notifier

import (
	"context"
	"sync"
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
// confirmation arms again, would not). One probe runs at a time; the lapse
// timer starts it, the session takes its result when it ends.
type lockProbe struct {
	try      func(ctx context.Context, key int64) *lockedConn // tryLock with the session's settings
	answered func() time.Time                                 // when a check last confirmed the lock
	ctx      context.Context                                  // the session's
	end      context.CancelCauseFunc                          // ends the session

	mu         sync.Mutex
	running    bool
	done       bool      // the session ended: no new probe
	lastEnd    time.Time // when the last probe found the lock held (or failed)
	streak     int       // probes in a row that found it held, checks answered between them
	quietUntil time.Time
	retry      *time.Timer
	won        *lockedConn
	wg         sync.WaitGroup
}

// start probes key after a lapse, unless a probe runs, probes pause (see
// slowStreak), the session ended or a probe took the lock.
func (p *lockProbe) start(key int64) { p.launch(key, false) }

// launch probes key; again (a probe's own retry) ignores the pause: no
// check was answered since that probe.
func (p *lockProbe) launch(key int64, again bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if key == 0 || p.running || p.done || p.won != nil || (!again && time.Now().Before(p.quietUntil)) {
		return
	}
	p.running = true
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		won := p.try(p.ctx, key)
		p.mu.Lock()
		p.running = false
		p.won = won
		if won == nil {
			p.held(key)
		}
		p.mu.Unlock()
		if won != nil {
			p.end(errLockMoved)
		}
	}()
}

// held takes in a probe that did not take the lock (p.mu held).
func (p *lockProbe) held(key int64) {
	now := time.Now()
	if !p.lastEnd.IsZero() && p.answered().After(p.lastEnd) {
		p.streak++
	} else {
		p.streak = 1
	}
	if p.streak >= slowStreak {
		p.streak = 0
		p.quietUntil = now.Add(probeQuiet)
	}
	p.lastEnd = now
	if p.retry != nil {
		p.retry.Stop()
	}
	p.retry = time.AfterFunc(OwnLockValidFor, func() {
		if !p.answered().After(now) {
			p.launch(key, true)
		}
	})
}

// result waits for a running probe and returns its connection if it took
// the lock; no probe starts after it.
func (p *lockProbe) result() *lockedConn {
	p.mu.Lock()
	p.done = true
	if p.retry != nil {
		p.retry.Stop()
	}
	p.mu.Unlock()
	p.wg.Wait()
	return p.won
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
