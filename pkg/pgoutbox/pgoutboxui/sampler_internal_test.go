package pgoutboxui

import (
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// The ring keeps the newest samples, oldest first, never more than its size.
func TestRingKeepsTheNewest(t *testing.T) {
	t.Parallel()
	r := newRing(3)
	_, ok := r.last()
	require.False(t, ok)
	for i := range 5 {
		r.add(sample{at: int64(i)})
	}
	var at []int64
	for _, s := range r.all() {
		at = append(at, s.at)
	}
	require.Equal(t, []int64{2, 3, 4}, at)
	last, ok := r.last()
	require.True(t, ok)
	require.EqualValues(t, 4, last.at)
}

// Rates span at least rateSpan, and a counter that falls (a requeue, a
// statistics reset) counts as 0, not as a negative rate.
func TestRates(t *testing.T) {
	t.Parallel()
	var ss []sample
	for i := range 6 {
		ss = append(ss, sample{at: int64(i) * 500, acked: int64(i) * 100}) // 200/s
	}
	pts := perSecond(ss, func(s sample) int64 { return s.acked })
	require.Len(t, pts, 5)
	for _, p := range pts {
		require.InDelta(t, 200, p.v, 0.001)
	}
	v, ok := rate(ss, func(s sample) int64 { return s.acked })
	require.True(t, ok)
	require.InDelta(t, 200, v, 0.001)
	_, ok = rate(ss[:1], func(s sample) int64 { return s.acked })
	require.False(t, ok)
	down := perSecond([]sample{{at: 0, dead: 10}, {at: 3000, dead: 4}}, func(s sample) int64 { return s.dead })
	require.Equal(t, []point{{3000, 0}}, down)
}

// A chart has a y axis from 0 to a round maximum, and a thinned series
// keeps its spikes.
func TestChart(t *testing.T) {
	t.Parallel()
	require.Equal(t, 1.0, niceCeil(0))
	require.Equal(t, 500.0, niceCeil(312))
	require.Equal(t, 2000.0, niceCeil(1001))
	pts := make([]point, 1000)
	for i := range pts {
		pts[i] = point{int64(i), 1}
	}
	pts[501].v = 90
	thinned := thin(pts, 100)
	require.Len(t, thinned, 100)
	peak := 0.0
	for _, p := range thinned {
		peak = max(peak, p.v)
	}
	require.Equal(t, 90.0, peak)
	c := newChart("Depth", "messages", pts, count)
	require.False(t, c.Empty)
	require.Equal(t, "100", c.YMax)
	require.Equal(t, c.PlotW, strings.Count(c.Line, ","), "thinned to a point per pixel")
	require.True(t, newChart("Depth", "", pts[:1], count).Empty)
}

// Observer events count per topic and group; published per topic. Each
// side counts as wired on its own events: a publisher's Observer alone
// does not make the acks' rate a 0.
func TestObserverCounts(t *testing.T) {
	t.Parallel()
	s := newSampler(nil, 0, 2, 10)
	s.observe(pgoutbox.Event{Kind: pgoutbox.EventPublished, Topic: "t", Count: 1})
	require.True(t, s.wiredPublishes.Load())
	require.False(t, s.wiredAcks.Load(), "no consumer's Observer yet")
	s.observe(pgoutbox.Event{Kind: pgoutbox.EventAcked, Topic: "t", Group: "g"})
	s.observe(pgoutbox.Event{Kind: pgoutbox.EventAcked, Topic: "t", Group: "g"})
	s.observe(pgoutbox.Event{Kind: pgoutbox.EventDeadLettered, Topic: "t", Group: "g"})
	s.observe(pgoutbox.Event{Kind: pgoutbox.EventPublished, Topic: "t", Count: 7})
	s.observe(pgoutbox.Event{Kind: pgoutbox.EventClaimed, Topic: "t", Group: "g", Count: 3})
	c := s.counts(pair{"t", "g"}, false)
	require.EqualValues(t, 2, c.acked.Load())
	require.EqualValues(t, 1, c.deadLettered.Load())
	require.EqualValues(t, 8, s.counts(pair{"t", publishedGroup}, false).published.Load())
	require.True(t, s.wiredAcks.Load())
}

// The whole outbox's sample sums every pair, also those beyond MaxPairs
// that get no chart of their own.
func TestWholeOutboxCountsPairsBeyondMaxPairs(t *testing.T) {
	t.Parallel()
	s := newSampler(nil, time.Second, 4, 1)
	stats := []pgoutbox.QueueStats{
		{Topic: "a", Ready: 3, Leased: 1, OldestReadyAge: 2 * time.Second},
		{Topic: "b", ConsumerGroup: "g", Ready: 5, Parked: 2, OldestReadyAge: 9 * time.Second, DeadLetters: map[string]int64{"rejected": 4}},
	}
	s.record(time.UnixMilli(1000), stats, nil, sample{})
	snap := s.snapshot(true)
	require.Len(t, snap.series, 1, "MaxPairs bounds the charted pairs")
	require.Len(t, snap.whole, 1)
	w := snap.whole[0]
	require.EqualValues(t, 8, w.ready)
	require.EqualValues(t, 1, w.leased)
	require.EqualValues(t, 2, w.parked)
	require.EqualValues(t, 4, w.dead)
	require.EqualValues(t, 9000, w.oldestMS)
	require.EqualValues(t, 1000, w.at)
}

// Options that would keep more than a GiB of samples are refused (New
// allocates its rings whole: a mistyped Samples crashed the process out of
// memory); the defaults keep about 15 MiB.
func TestSamplesAreBoundedByTheirMemory(t *testing.T) {
	o, def := Options{Samples: 1_000_000_000}, Options{}
	o.setDefaults()
	def.setDefaults()
	err := o.validate()
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "keep it under 1 GiB")
	require.NoError(t, def.validate())
	require.EqualValues(t, 88, unsafe.Sizeof(sample{}), "the size the docs give")
}

// A PageTimeout of nanoseconds (a bare number) is refused: every page
// would time out before it read anything. Negative means no bound.
func TestPageTimeoutOfNanosecondsIsRefused(t *testing.T) {
	o := Options{PageTimeout: 15}
	o.setDefaults()
	err := o.validate()
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "PageTimeout is 15ns; it must be at least 1ms")
	o.PageTimeout = -1
	require.NoError(t, o.validate())
}
