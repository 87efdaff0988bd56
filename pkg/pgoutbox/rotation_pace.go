package pgoutbox

import (
	"sync"
	"time"
)

// rotationPace spaces the rotation steps of one outbox taken by the
// Subscribers of this process. Each Subscriber runs a rotator, and a step
// that meets a transaction holding a partition makes every claim of the
// outbox wait up to schema.RotateLockTimeout (its TRUNCATE's lock request
// queues them): a step per rotator each fifth of a window made claims
// wait N times as often with N Subscribers (12 Subscribers, a 3 s window:
// claims blocked 22-23% of the time, against 8% with one;
// tests/bench/rotationstall). So the
// rotators of an outbox take turns, one step each fifth of a window
// between them, and after a step whose TRUNCATE gave up on its lock the
// next waits longer, doubling up to a window: while a long transaction
// holds a partition, the ring waits for it anyway.
type rotationPace struct {
	mu      sync.Mutex
	next    time.Time     // no step before
	backoff time.Duration // after lock timeouts in a row; 0: none
}

// rotationPaces holds a pace per database, outbox and rotation window.
var rotationPaces sync.Map // rotationKey -> *rotationPace

// rotationKey names an outbox's rotators that share a pace: those of one
// window, so that a Subscriber with a long one does not space the steps
// of one with a short one.
type rotationKey struct {
	outbox string // Subscriber.outbox
	window time.Duration
}

func paceOf(k rotationKey) *rotationPace {
	p, _ := rotationPaces.LoadOrStore(k, &rotationPace{})
	return p.(*rotationPace)
}

// turn reports whether a rotator may step now, and if so books the step:
// the next comes every later, at the earliest. A quarter of every is
// slack: a rotator's ticker fires every apart, but the clock read after
// it runs late by a varying delay, and without slack one rotator alone
// missed one tick in four, its steps 1.3-1.5 fifths of a window apart.
func (p *rotationPace) turn(now time.Time, every time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if now.Before(p.next.Add(-every / 4)) {
		return false
	}
	p.next = now.Add(every)
	return true
}

// stepped takes in a step's outcome: lockTimeouts, the TRUNCATEs that gave
// up on their lock, push the next step back (every, doubled each time, up
// to window); a step without any ends that.
func (p *rotationPace) stepped(now time.Time, lockTimeouts int, every, window time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if lockTimeouts == 0 {
		p.backoff = 0
		return
	}
	p.backoff = min(max(2*p.backoff, every), window)
	p.next = now.Add(p.backoff)
}
