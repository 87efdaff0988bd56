package pgoutbox

import (
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// retryGate paces the retries of a statement that failed: claims and
// writes each have one. After a failure it stays shut for a backoff (50ms
// doubling to 5s, with jitter, forever); a success opens it and resets the
// backoff.
type retryGate struct {
	bo       *backoff.ExponentialBackOff
	until    time.Time     // shut until then; zero: open
	failures int           // in a row, since the last success
	since    time.Time     // the first of them
	most     time.Duration // the longest backoff after hurry; zero: the backoff's own
}

func newRetryGate() retryGate {
	// Options, not fields: NewExponentialBackOff resets itself, so fields
	// set afterwards would only apply after the next Reset.
	return retryGate{bo: backoff.NewExponentialBackOff(backoff.WithInitialInterval(50*time.Millisecond),
		backoff.WithMaxInterval(5*time.Second), backoff.WithMaxElapsedTime(0))}
}

// failed shuts the gate for the next backoff and returns its length.
func (g *retryGate) failed(now time.Time) time.Duration {
	wait := g.bo.NextBackOff()
	if g.most > 0 {
		wait = min(wait, jitter(g.most))
	}
	g.until = now.Add(wait)
	if g.failures == 0 {
		g.since = now
	}
	g.failures++
	return wait
}

// succeeded opens the gate and resets the backoff.
func (g *retryGate) succeeded() {
	g.bo.Reset()
	g.until = time.Time{}
	g.failures = 0
}

// hurry opens the gate and keeps each backoff from now on under most:
// Close's last writes are tried until their deadline, not after a backoff
// that grew during an outage which has ended meanwhile.
func (g *retryGate) hurry(most time.Duration) {
	g.until, g.most = time.Time{}, most
}

// shut reports whether the gate is shut; passedTimes opens it once its
// time has come (pass).
func (g *retryGate) shut() bool { return !g.until.IsZero() }

// pass opens the gate if its backoff is over.
func (g *retryGate) pass(now time.Time) {
	if !g.until.IsZero() && !now.Before(g.until) {
		g.until = time.Time{}
	}
}

// jitter spreads d by ±20% so idle subscribers do not poll in lockstep.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}
