package pgoutboxui

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// pair is one consumer group of one topic.
type pair struct{ topic, group string }

// sample is one observation of a pair: 88 bytes, so a ring of the default
// 360 samples costs about 31 KiB per pair.
type sample struct {
	at                                        int64 // unix milliseconds
	ready, scheduled, leased, expired, parked int64
	dead                                      int64 // dead letters (all reasons)
	oldestMS                                  int64 // oldest ready age
	acked, deadLettered                       int64 // Observer counts so far (0 without an Observer)
	published                                 int64 // Observer count of the topic's published messages
}

func (s sample) depth() int64 { return s.ready + s.scheduled + s.leased + s.expired }

// ring is a bounded series of samples, oldest first.
type ring struct {
	buf   []sample
	start int
	n     int
}

func newRing(size int) *ring { return &ring{buf: make([]sample, size)} }

func (r *ring) add(s sample) {
	if r.n < len(r.buf) {
		r.buf[(r.start+r.n)%len(r.buf)] = s
		r.n++
		return
	}
	r.buf[r.start] = s
	r.start = (r.start + 1) % len(r.buf)
}

func (r *ring) all() []sample {
	out := make([]sample, r.n)
	for i := range out {
		out[i] = r.buf[(r.start+i)%len(r.buf)]
	}
	return out
}

func (r *ring) last() (sample, bool) {
	if r.n == 0 {
		return sample{}, false
	}
	return r.buf[(r.start+r.n-1)%len(r.buf)], true
}

// publishedGroup keys a topic's published count among the pairs' counts
// (groups cannot hold control characters).
const publishedGroup = "\x00published"

// counts are the Observer's counts of one pair (published: of a topic,
// under group "").
type counts struct{ acked, deadLettered, published atomic.Int64 }

// sampler takes a Stats sample of the whole outbox every interval, in one
// goroutine per UI, into a ring per pair. Pages read its latest sample.
type sampler struct {
	ui       *UI
	interval time.Duration
	size     int
	maxPairs int

	mu       sync.Mutex
	series   map[pair]*ring
	lastSeen map[pair]int64
	// totals are the table counters, in sample's fields: ready = outbox
	// rows inserted, scheduled = deleted, dead = dead letters inserted.
	totals *ring
	// whole sums every pair's sample, charted or not (MaxPairs bounds
	// only the pairs' own charts).
	whole    *ring
	latest   []pgoutbox.QueueStats
	bound    map[pair]bool
	latestAt time.Time
	err      error
	taken    chan struct{} // closed after the first sample
	cost     time.Duration // how long the last sample took

	obsMu sync.Mutex
	obs   map[pair]*counts
	// An Observer reported at least one ack or dead letter (a consumer's),
	// or one publish (a publisher's): each rate needs its own side wired.
	wiredAcks, wiredPublishes atomic.Bool
}

func newSampler(ui *UI, interval time.Duration, size, maxPairs int) *sampler {
	return &sampler{
		ui: ui, interval: interval, size: size, maxPairs: maxPairs,
		series: map[pair]*ring{}, lastSeen: map[pair]int64{}, totals: newRing(size), whole: newRing(size),
		taken: make(chan struct{}), obs: map[pair]*counts{},
	}
}

// run samples until ctx ends.
func (s *sampler) run(ctx context.Context) {
	first := true
	t := time.NewTicker(s.interval)
	defer t.Stop()
	for {
		s.take(ctx)
		if first {
			close(s.taken)
			first = false
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// take reads Stats, the bindings and the table counters once and records
// them. A failed sample keeps the previous one and reports the error.
func (s *sampler) take(ctx context.Context) {
	bound := max(s.interval, 5*time.Second)
	sctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	start := time.Now()
	stats, err := pgoutbox.Stats(sctx, s.ui.exec, s.ui.tables)
	var bindings map[pair]bool
	if err == nil {
		bindings, err = s.ui.bindings(sctx)
	}
	var tot sample
	if err == nil {
		tot, err = s.ui.tableTotals(sctx)
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		if ctx.Err() == nil && sctx.Err() != nil {
			// Behind an exclusive lock every statement waits: say what may
			// hold it, as a page that gives up does.
			err = fmt.Errorf("%w%s; the figures shown are the last sample's that succeeded", err, errtext.NoAnswer(bound))
		}
		if ctx.Err() == nil || s.err == nil {
			s.err = err
		}
		return
	}
	s.err = nil
	s.cost = now.Sub(start) // shown beside the sample's time: a failed one's would be read as its
	s.record(now, stats, bindings, tot)
}

// record adds one sample of stats, bound and the table counters tot
// taken at now.
func (s *sampler) record(now time.Time, stats []pgoutbox.QueueStats, bound map[pair]bool, tot sample) {
	s.latest, s.bound, s.latestAt = stats, bound, now
	ms := now.UnixMilli()
	tot.at = ms
	s.totals.add(tot)
	whole := sample{at: ms}
	for _, st := range stats {
		p := pair{st.Topic, st.ConsumerGroup}
		smp := sample{at: ms, ready: st.Ready, scheduled: st.Scheduled, leased: st.Leased, expired: st.ExpiredLeases,
			parked: st.Parked, oldestMS: st.OldestReadyAge.Milliseconds()}
		for _, n := range st.DeadLetters {
			smp.dead += n
		}
		whole.add(smp)
		r := s.series[p]
		if r == nil {
			if len(s.series) >= s.maxPairs {
				continue // bounded: the overview still lists it, without a chart
			}
			r = newRing(s.size)
			s.series[p] = r
		}
		if c := s.counts(p, false); c != nil {
			smp.acked, smp.deadLettered = c.acked.Load(), c.deadLettered.Load()
		}
		if c := s.counts(pair{p.topic, publishedGroup}, false); c != nil {
			smp.published = c.published.Load()
		}
		r.add(smp)
		s.lastSeen[p] = ms
	}
	s.whole.add(whole)
	// A pair gone for a whole ring's span has nothing left to chart.
	span := int64(s.size) * s.interval.Milliseconds()
	for p, seen := range s.lastSeen {
		if ms-seen > span {
			delete(s.series, p)
			delete(s.lastSeen, p)
		}
	}
}

// counts returns the Observer counts of p, creating them when create is set.
func (s *sampler) counts(p pair, create bool) *counts {
	s.obsMu.Lock()
	defer s.obsMu.Unlock()
	c := s.obs[p]
	if c == nil && create && len(s.obs) < 4*s.maxPairs {
		c = &counts{}
		s.obs[p] = c
	}
	return c
}

// observe counts an Observer event.
func (s *sampler) observe(e pgoutbox.Event) {
	switch e.Kind {
	case pgoutbox.EventAcked, pgoutbox.EventDeadLettered:
		c := s.counts(pair{e.Topic, e.Group}, true)
		if c == nil {
			return
		}
		s.wiredAcks.Store(true)
		if e.Kind == pgoutbox.EventAcked {
			c.acked.Add(1)
		} else {
			c.deadLettered.Add(1)
		}
	case pgoutbox.EventPublished:
		if c := s.counts(pair{e.Topic, publishedGroup}, true); c != nil {
			s.wiredPublishes.Store(true)
			c.published.Add(int64(e.Count))
		}
	}
}

// snapshot is what a page needs of the sampler, copied under its lock.
type snapshot struct {
	stats  []pgoutbox.QueueStats
	bound  map[pair]bool
	at     time.Time
	err    error
	cost   time.Duration
	series map[pair][]sample
	totals []sample
	whole  []sample // every pair's samples summed
	// wiredAcks, wiredPublishes: see sampler.
	wiredAcks, wiredPublishes bool
}

// snapshot returns the latest sample; with all, every pair's series too,
// else only those of want.
func (s *sampler) snapshot(all bool, want ...pair) snapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	snap := snapshot{stats: s.latest, bound: s.bound, at: s.latestAt, err: s.err, cost: s.cost,
		series: map[pair][]sample{}, totals: s.totals.all(), whole: s.whole.all(),
		wiredAcks: s.wiredAcks.Load(), wiredPublishes: s.wiredPublishes.Load()}
	if all {
		for p, r := range s.series {
			snap.series[p] = r.all()
		}
	}
	for _, p := range want {
		if r := s.series[p]; r != nil {
			snap.series[p] = r.all()
		}
	}
	return snap
}

// rate is the per-second change of f over the last rateSpan of samples
// (or the last two samples, if further apart); false when there are fewer
// than two.
func rate(ss []sample, f func(sample) int64) (float64, bool) {
	if len(ss) < 2 {
		return 0, false
	}
	b := ss[len(ss)-1]
	a := ss[len(ss)-2]
	for i := len(ss) - 2; i >= 0 && b.at-a.at < rateSpan.Milliseconds(); i-- {
		a = ss[i]
	}
	dt := float64(b.at-a.at) / 1000
	if dt <= 0 {
		return 0, false
	}
	return float64(f(b)-f(a)) / dt, true
}

// perSecond turns a cumulative counter series into a rate series (one
// point fewer; negative steps, from a reset or a requeue, count as 0). Each
// rate spans at least rateSpan: table statistics arrive in steps of about
// a second, and a shorter span would show the steps, not the rate.
func perSecond(ss []sample, f func(sample) int64) []point {
	var out []point
	j := 0
	for i := 1; i < len(ss); i++ {
		for j+1 < i && ss[i].at-ss[j+1].at >= rateSpan.Milliseconds() {
			j++
		}
		dt := float64(ss[i].at-ss[j].at) / 1000
		if dt <= 0 {
			continue
		}
		out = append(out, point{ss[i].at, max(0, float64(f(ss[i])-f(ss[j]))/dt)})
	}
	return out
}

const rateSpan = 2 * time.Second

// gauge turns a series into points.
func gauge(ss []sample, f func(sample) float64) []point {
	out := make([]point, len(ss))
	for i, s := range ss {
		out[i] = point{s.at, f(s)}
	}
	return out
}

// add sums o into s (the oldest ready age: the larger).
func (s *sample) add(o sample) {
	s.ready += o.ready
	s.scheduled += o.scheduled
	s.leased += o.leased
	s.expired += o.expired
	s.parked += o.parked
	s.dead += o.dead
	s.oldestMS = max(s.oldestMS, o.oldestMS)
	s.acked += o.acked
	s.deadLettered += o.deadLettered
	s.published += o.published
}

// tableTotals reads the outbox's and the dead-letter table's counters.
func (ui *UI) tableTotals(ctx context.Context) (sample, error) {
	var s sample
	rows, err := ui.exec.Query(ctx, query.UITableCounters, ui.names.QTable)
	if err != nil {
		return s, err
	}
	if rows.Next() {
		err = rows.Scan(&s.ready, &s.scheduled)
	}
	rows.Close()
	if err == nil {
		err = rows.Err()
	}
	if err != nil || ui.names.QDLQ == "" {
		return s, err
	}
	rows, err = ui.exec.Query(ctx, query.UITableCounters, ui.names.QDLQ)
	if err != nil {
		return s, err
	}
	var del int64
	if rows.Next() {
		err = rows.Scan(&s.dead, &del)
	}
	rows.Close()
	if err == nil {
		err = rows.Err()
	}
	return s, err
}
