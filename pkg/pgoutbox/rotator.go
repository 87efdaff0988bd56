package pgoutbox

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// rotator runs the rotation steps of a rotating outbox (schema.Rotate)
// beside a Subscriber's subscriptions, while it has one. Every Subscriber
// of the outbox runs one; the rotators of a process take turns
// (rotationPace), and a step that finds another session rotating does
// nothing. Only its goroutine touches it.
type rotator struct {
	s       *Subscriber
	stop    chan struct{} // closed when the last subscription ended
	every   time.Duration // between steps: a fifth of the window
	pace    *rotationPace // shared with the process's other rotators of the outbox
	failing bool          // the last step failed: logged once per outage
}

// startRotator starts a rotator for a rotating outbox unless one runs. The
// caller holds s.mu: the subscription it starts for counts as running.
func (s *Subscriber) startRotator() {
	if !s.cfg.Tables.Rotating || s.stopRotator != nil {
		return
	}
	key := rotationKey{outbox: s.outbox(), window: s.cfg.RotationWindow}
	r := &rotator{s: s, stop: make(chan struct{}), every: max(s.cfg.RotationWindow/5, 10*time.Millisecond), pace: paceOf(key)}
	s.stopRotator = func() { close(r.stop) }
	s.subs.Add(1)
	go func() {
		defer s.subs.Done()
		r.run()
	}()
}

func (r *rotator) run() {
	// Neither Close nor the last subscription's end waits for a step to
	// end: they cancel it (a closed pool would fail it anyway).
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-r.s.closing:
		case <-r.stop:
		case <-ctx.Done():
		}
		cancel()
	}()
	t := time.NewTicker(r.every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if r.pace.turn(time.Now(), r.every) {
			r.step(ctx)
		}
	}
}

func (r *rotator) step(parent context.Context) {
	ctx, cancel := context.WithTimeout(parent, r.s.cfg.StatementTimeout)
	defer cancel()
	res, err := schema.Rotate(ctx, tx.FromPgxPool(r.s.pool), r.s.cfg.Tables, r.s.cfg.RotationWindow)
	if err != nil && parent.Err() != nil {
		return // closing
	}
	if err != nil {
		if !r.failing {
			msg := "Rotating the outbox failed; rows go on into the current partition, retrying every step"
			if r.singleTable(parent) {
				msg = "Rotating the outbox failed: it is a single table now (schema.ConvertToSingle, pgoutbox schema convert-to-single), " +
					"so rows go into that table and nothing rotates; unset Rotating in the Config and restart, retrying every step meanwhile"
			}
			r.s.logger.Error(msg, err, watermill.LogFields{"every": r.every.String()})
		}
		r.failing = true
		return
	}
	if !res.Busy { // another session's step says nothing of the lock
		r.pace.stepped(time.Now(), res.LockTimeouts, r.every, r.s.cfg.RotationWindow)
	}
	if r.failing {
		r.s.logger.Info("Rotating the outbox works again", nil)
	}
	r.failing = false
	if res.Advanced || len(res.Truncated) > 0 || res.Moved > 0 {
		r.s.logger.Debug("Rotated the outbox", watermill.LogFields{
			"current": res.Current, "advanced": res.Advanced, "truncated": res.Truncated, "moved": res.Moved, "lock_timeouts": res.LockTimeouts})
	}
}

// singleTable reports whether the catalog shows the outbox as a single
// table: converted back (schema.ConvertToSingle) while this Subscriber,
// still set to Rotating, runs.
func (r *rotator) singleTable(parent context.Context) bool {
	ctx, cancel := context.WithTimeout(parent, r.s.cfg.StatementTimeout)
	defer cancel()
	t := r.s.cfg.Tables.WithDefaults()
	var kind string
	err := r.s.pool.QueryRow(ctx, query.CatalogRotating, t.Schema, t.Table).Scan(&kind)
	return err == nil && kind == "table"
}
