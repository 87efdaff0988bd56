package pgoutbox

import (
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/pgoutbox/watermill-pgoutbox/internal/logbudget"
)

// retryGate paces the retries of a statement that failed: claims and
// writes each have one. After a failure it stays shut for a backoff (50ms
// growing to retryAtMost, with jitter, forever); a success opens it and
// resets the backoff. The news that the server answers again (serverBack)
// opens it without resetting the backoff.
type retryGate struct {
	bo       *backoff.ExponentialBackOff
	until    time.Time        // shut until then; zero: open
	failures int              // in a row, since the last success
	since    time.Time        // the first of them
	most     time.Duration    // the longest backoff after hurry; zero: the backoff's own
	logged   time.Time        // the last failure logged as an error (shouldLog)
	budget   logbudget.Budget // across failures in a row that successes split
	back     time.Time        // the last time serverBack opened the gate
}

// retryAtMost bounds a claim's or a write's backoff (±50%): after an
// outage, messages flow again within about it of the server's return,
// as watermill-sql's subscriber retries a failed query after a second. A
// retry that fails costs one short statement or a refused connection.
const retryAtMost = 2 * time.Second

// Failures in a row logged as errors before shouldLog thins them out to
// one per loggedFailuresEvery: a long outage then writes a line every
// half minute per subscription, with the count, instead of one per retry.
const (
	loggedFailures      = logbudget.PerWindow
	loggedFailuresEvery = logbudget.Window
)

func newRetryGate() retryGate {
	// Options, not fields: NewExponentialBackOff resets itself, so fields
	// set afterwards would only apply after the next Reset.
	return retryGate{bo: backoff.NewExponentialBackOff(backoff.WithInitialInterval(50*time.Millisecond),
		backoff.WithMaxInterval(retryAtMost), backoff.WithMaxElapsedTime(0))}
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

// serverBack opens the gate: the notifier's connection was made again, so
// the server answers. The backoff is not reset: if the next try fails
// all the same (a grant missing, a lock), the one after waits as long as
// it would have. At most once per retryAtMost: a LISTEN connection that
// keeps dropping and coming back must not turn a failure that no
// reconnect mends into a retry every 100ms.
func (g *retryGate) serverBack(now time.Time) {
	if g.until.IsZero() || now.Sub(g.back) < retryAtMost {
		return
	}
	g.until, g.back = time.Time{}, now
}

// shouldLog reports whether the failure just counted (failed) is logged
// as an error: the first loggedFailures in a row, then one per
// loggedFailuresEvery, and of short runs of failures no more than the
// budget allows; the others go to the debug log.
func (g *retryGate) shouldLog(now time.Time) bool {
	if g.failures <= loggedFailures && g.budget.Take(now) || g.failures > loggedFailures && now.Sub(g.logged) >= loggedFailuresEvery {
		g.logged = now
		return true
	}
	return false
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
