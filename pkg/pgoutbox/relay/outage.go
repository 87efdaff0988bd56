package relay

import (
	"context"
	"sync"
	"time"
)

// outage paces a Relay while its target keeps failing. Without it every
// worker would claim, try and nack the whole backlog again and again while
// a broker is down (each row waits out its own retry delay, but a backlog
// has rows due at every moment): a storm of failed publishes and log
// lines, and load on the database that grows with the backlog. After a
// failed batch each worker waits before taking the next, twice as long
// after each further failure, up to outageMaxPause; the first success ends
// the outage and wakes the workers that wait. One per topic, shared by
// its workers: a target may refuse one topic (a subject no stream
// captures, a missing exchange, a denied grant) and take the others, whose
// successes must neither end that topic's outage nor be paused by it.
type outage struct {
	mu        sync.Mutex
	failures  int           // failed batches since the last success
	until     time.Time     // workers take no batch before then
	logged    time.Time     // the last failure logged
	recovered chan struct{} // closed by the success that ends the outage
}

func newOutage() *outage { return &outage{recovered: make(chan struct{})} }

// Bounds of the pause between batches while the target fails.
const (
	outageFirstPause = 100 * time.Millisecond
	outageMaxPause   = 10 * time.Second
	// outageLogEvery: while an outage lasts, a failure is logged at most
	// this often (the first one at once).
	outageLogEvery = 30 * time.Second
)

// failed records a failed batch at now; it returns the failures of this
// outage so far, and whether to log this one.
func (o *outage) failed(now time.Time) (failures int, log bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.failures++
	pause := outageFirstPause << min(o.failures-1, 10)
	o.until = now.Add(min(pause, outageMaxPause))
	log = o.failures == 1 || now.Sub(o.logged) >= outageLogEvery
	if log {
		o.logged = now
	}
	return o.failures, log
}

// succeeded ends the outage, returning how many batches it failed.
func (o *outage) succeeded() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := o.failures
	o.failures, o.until = 0, time.Time{}
	if n > 0 {
		close(o.recovered)
		o.recovered = make(chan struct{})
	}
	return n
}

// wait returns once the pause of the outage has passed, a publish
// succeeded, ctx ended or closed is closed.
func (o *outage) wait(ctx context.Context, closed <-chan struct{}) {
	o.mu.Lock()
	d, recovered := time.Until(o.until), o.recovered
	o.mu.Unlock()
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-recovered:
	case <-ctx.Done():
	case <-closed:
	}
}
