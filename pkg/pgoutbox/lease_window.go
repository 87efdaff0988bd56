package pgoutbox

import (
	"sync"
	"time"
)

// Prefetch bounds. A busy subscription leases more rows than it has in
// flight, so one claim statement serves many messages (a claim costs about
// the same for 10 rows as for 200); the extra rows wait in a local buffer.
// The buffer is sized to what the handlers consumed in the last
// prefetchHorizon, so rows never sit leased locally for long, and an idle or
// slow subscription prefetches nothing: its claims only fill free slots.
const (
	prefetchHorizon = 10 * time.Millisecond
	maxPrefetch     = 1024
	// maxClaim caps one claim statement: past a couple of hundred rows a
	// claim costs the same per row, and a smaller claim returns sooner, so
	// the buffer is refilled before it runs dry. (A second claim loop on its
	// own connection was tried: on 2 cores it cost a tenth of the drain
	// rate, the two loops and PostgreSQL competing for the same CPUs.)
	maxClaim = 256
	// rateSample is the shortest interval a consumption rate is measured
	// over; claims closer together accumulate into one sample.
	rateSample = 5 * time.Millisecond
)

// leaseWindow counts the rows a subscription holds leased without a
// recorded verdict: at most MaxInFlight handed out plus the prefetch buffer.
type leaseWindow struct {
	mu         sync.Mutex
	held       int
	inFlight   int  // MaxInFlight
	noPrefetch bool // MaxDeliveries is set: a buffered row would count as delivered
	prefetch   int  // current allowance, adapted to the consumption rate
	rate       float64
	completed  int // verdicts since the last rate sample
	sampledAt  time.Time
	freed      chan struct{} // signalled when held goes down
}

// newLeaseWindow returns a window for maxInFlight handed-out rows, with a
// prefetch buffer unless disabled.
func newLeaseWindow(maxInFlight int, prefetch bool) *leaseWindow {
	return &leaseWindow{inFlight: maxInFlight, noPrefetch: !prefetch, sampledAt: time.Now(), freed: make(chan struct{}, 1)}
}

// acquire waits until a claim is worth making and reserves room for it: any
// free slot while nothing is prefetched (so a slow subscription claims as
// soon as a handler is free), half the prefetch allowance otherwise (so a
// busy one claims in batches). It returns how many rows to claim, or 0 when
// stop closes first.
func (w *leaseWindow) acquire(stop <-chan struct{}) int {
	for {
		select {
		case <-stop: // checked first: a stopping subscription claims nothing
			return 0
		default:
		}
		w.mu.Lock()
		w.sample(time.Now())
		limit := w.inFlight + w.prefetch
		free := limit - w.held
		if free >= max(1, min(w.prefetch/2, maxClaim/2)) {
			n := min(free, max(maxClaim, w.inFlight))
			w.held += n
			w.mu.Unlock()
			return n
		}
		w.mu.Unlock()
		select {
		case <-stop:
			return 0
		case <-w.freed:
		}
	}
}

// unreserve gives back room a claim did not fill.
func (w *leaseWindow) unreserve(n int) {
	w.mu.Lock()
	w.held -= n
	w.mu.Unlock()
	w.signal()
}

// done records n verdicts: their rows no longer count against the window.
func (w *leaseWindow) done(n int) {
	w.mu.Lock()
	w.held -= n
	w.completed += n
	w.mu.Unlock()
	w.signal()
}

func (w *leaseWindow) signal() {
	select {
	case w.freed <- struct{}{}:
	default:
	}
}

// sample updates the consumption rate and the prefetch allowance; w.mu held.
func (w *leaseWindow) sample(now time.Time) {
	elapsed := now.Sub(w.sampledAt)
	if elapsed < rateSample {
		return
	}
	current := float64(w.completed) / elapsed.Seconds()
	switch {
	case current > w.rate || elapsed > 10*rateSample:
		// Up at once (a backlog should not wait for an average to catch
		// up), and a long quiet interval counts as one sample: an idle
		// subscription stops prefetching.
		w.rate = current
	default:
		w.rate = 0.5*w.rate + 0.5*current // down smoothly
	}
	w.completed, w.sampledAt = 0, now
	if !w.noPrefetch {
		w.prefetch = min(int(w.rate*prefetchHorizon.Seconds()), maxPrefetch)
	}
}
