package pgoutbox

import (
	"math"
	"time"
)

// Prefetch bounds. A busy subscription leases more rows than it has in
// flight, so one claim statement serves many messages (a claim costs about
// the same for 10 rows as for 200); the extra rows wait in a local buffer.
// The buffer is sized to what the handlers consumed in the last
// prefetchHorizon, so rows never sit leased locally for long, and an idle or
// slow subscription prefetches nothing: its claims only fill free slots.
const (
	prefetchHorizon = 40 * time.Millisecond
	maxPrefetch     = 4096
	// maxClaim caps one claim statement. A claim's fixed cost (its
	// round trip, the plan's start, the walk to the first due row) is
	// shared by its rows: 1,024-row claims drain a lease backlog about a
	// fifth faster than 256-row ones, with less server CPU a message
	// (tests/bench, drain-16 of pgoutbox-lease; docs/performance.md),
	// and the buffer above covers the longer statement. (A second claim
	// loop on its own connection was tried: on 2 cores it cost a tenth of
	// the drain rate, the two loops and PostgreSQL competing for the same
	// CPUs.)
	maxClaim = 1024
	// maxKeyedAllowance caps the buffer of a keyed subscription (see
	// keyedAllowance): a row held there is a key no competitor can run.
	maxKeyedAllowance = 1024
	// maxKeyedClaim caps a keyed subscription's claim: a keyed claim reads
	// a window of twice its rows (claimScan.request), and a backlog whose
	// keys are all held costs one window per claim.
	maxKeyedClaim = 256
	// rateSample is the shortest interval a consumption rate is measured
	// over; verdicts closer together accumulate into one sample.
	rateSample = 5 * time.Millisecond
	// maxPrefetchBytes bounds the rows a subscription holds beyond its
	// handlers, and one claim statement, by their size (payload and
	// metadata, as the claims so far averaged them): with 1 MiB payloads
	// and fast handlers, a rate measured over a burst of acks made one
	// claim read hundreds of rows, hundreds of megabytes, where
	// prefetching rows that large buys no speed (TestPrefetchIsBoundedBySize).
	maxPrefetchBytes = 16 << 20
)

// prefetch sizes a subscription's lease window from its consumption rate:
// at most MaxInFlight handed out plus an allowance for the buffer. It is
// owned by the subscription's owner goroutine.
type prefetch struct {
	inFlight  int  // MaxInFlight
	disabled  bool // MaxDeliveries is set: a buffered row would count as delivered
	allowance int  // current prefetch allowance, adapted to the rate
	rate      float64
	completed int // verdicts since the last sample
	sampledAt time.Time
	rowBytes  float64 // the claimed rows' average size (payload and metadata); 0: none claimed yet
}

// claimed records the sizes of the rows of a claim.
func (p *prefetch) claimed(rows []*delivery) {
	if len(rows) == 0 {
		return
	}
	total := 0
	for _, d := range rows {
		total += len(d.payload) + len(d.metaRaw)
	}
	avg := float64(total) / float64(len(rows))
	if p.rowBytes == 0 || avg > p.rowBytes {
		p.rowBytes = avg // up at once: a turn to large rows must not wait
	} else {
		p.rowBytes = 0.5*p.rowBytes + 0.5*avg
	}
}

// bySize is how many rows of the average size fit in maxPrefetchBytes, at
// least one; no bound before a claim has measured them.
func (p *prefetch) bySize() int {
	if p.rowBytes == 0 {
		return math.MaxInt
	}
	return max(1, int(maxPrefetchBytes/p.rowBytes))
}

func newPrefetch(maxInFlight int, enabled bool, now time.Time) prefetch {
	return prefetch{inFlight: maxInFlight, disabled: !enabled, sampledAt: now}
}

// verdicts records n verdicts (consumed rows).
func (p *prefetch) verdicts(n int) { p.completed += n }

// claimSize returns how many rows to claim when held rows are leased and
// not yet judged, or 0 when a claim is not worth making yet: any free slot
// while nothing is prefetched (a slow subscription claims as soon as a
// handler is free), half the allowance otherwise (a busy one claims in
// batches). keyed: the rows have ordering keys (see keyedAllowance).
func (p *prefetch) claimSize(held int, now time.Time, keyed bool) int {
	p.sample(now)
	allowance, limit := p.allowance, maxClaim
	if keyed && !p.disabled {
		allowance, limit = p.keyedAllowance(), maxKeyedClaim
	}
	bySize := p.bySize()
	allowance = min(allowance, bySize)
	free := p.inFlight + allowance - held
	if free < max(1, min(allowance/2, limit/2)) {
		return 0
	}
	return min(free, max(limit, p.inFlight), bySize)
}

// keyedTurnaround is how long a key's next row takes to reach the buffer
// after its previous one was answered: the ack's write, then the claim
// that asks for the key (a few milliseconds; more under load).
const keyedTurnaround = 25 * time.Millisecond

// keyedAllowance is the buffer of a subscription whose rows have ordering
// keys. It holds one row per key, and a key's next row comes only after
// the previous one was written and a claim asked for it: over that
// turnaround the handlers, at the measured rate, need rows of other keys
// in hand. No more: a row held here is a key no other subscriber can run,
// though it may have handlers free (a slow subscription that held a row
// of every key starved its competitors). At least MaxInFlight, so that
// the rate can grow to what the handlers do; at most maxKeyedAllowance.
func (p *prefetch) keyedAllowance() int {
	return min(maxKeyedAllowance, max(p.inFlight, int(p.rate*keyedTurnaround.Seconds())))
}

// sample updates the consumption rate and the allowance.
func (p *prefetch) sample(now time.Time) {
	elapsed := now.Sub(p.sampledAt)
	if elapsed < rateSample {
		return
	}
	current := float64(p.completed) / elapsed.Seconds()
	switch {
	case current > p.rate || elapsed > 10*rateSample:
		// Up at once (a backlog should not wait for an average to catch
		// up), and a long quiet interval counts as one sample: an idle
		// subscription stops prefetching.
		p.rate = current
	default:
		p.rate = 0.5*p.rate + 0.5*current // down smoothly
	}
	p.completed, p.sampledAt = 0, now
	if !p.disabled {
		p.allowance = min(int(p.rate*prefetchHorizon.Seconds()), maxPrefetch)
	}
}
