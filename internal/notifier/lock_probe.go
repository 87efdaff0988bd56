package notifier

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// probeQuiet is how long a session makes no new probe after one found its
// lock still held (a slow path, not a half-open one) or could not connect:
// a path that slow stays slow, and each probe is a new server session.
const probeQuiet = 10 * LivenessEvery

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
// the path is only slow: the probe closes. One per session at a time; the
// lapse timer starts it, the session takes its result when it ends.
type lockProbe struct {
	try func(ctx context.Context, key int64) *lockedConn // tryLock with the session's settings
	ctx context.Context                                  // the session's
	end context.CancelCauseFunc                          // ends the session

	mu         sync.Mutex
	running    bool
	done       bool // the session ended: no new probe
	quietUntil time.Time
	won        *lockedConn
	wg         sync.WaitGroup
}

// start probes key unless a probe runs, one found the lock held or failed
// less than probeQuiet ago, or the session ended.
func (p *lockProbe) start(key int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if key == 0 || p.running || p.done || p.won != nil || time.Now().Before(p.quietUntil) {
		return
	}
	p.running = true
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		won := p.try(p.ctx, key)
		p.mu.Lock()
		p.running = false
		if won == nil {
			p.quietUntil = time.Now().Add(probeQuiet)
		}
		p.won = won
		p.mu.Unlock()
		if won != nil {
			p.end(errLockMoved)
		}
	}()
}

// result waits for a running probe and returns its connection if it took
// the lock; no probe starts after it.
func (p *lockProbe) result() *lockedConn {
	p.mu.Lock()
	p.done = true
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
