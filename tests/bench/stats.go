package main

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// result is what one run of one scenario for one system measured. Figures
// that do not apply to the scenario stay 0.
type result struct {
	msgsPerS float64
	p50ms    float64
	p99ms    float64
	// CPU time per message, µs: the server's and the bench process's
	// (drains only; -1 where unknown: a server on another machine).
	serverUs, clientUs float64
	note               string
}

// figures formats the figures that apply, for the progress lines.
func (r result) figures() string {
	var parts []string
	if r.msgsPerS != 0 {
		parts = append(parts, fmt.Sprintf("%10.1f msg/s", r.msgsPerS))
	}
	if r.serverUs > 0 || r.clientUs > 0 {
		parts = append(parts, fmt.Sprintf("cpu/msg server %5.1f µs  client %5.1f µs", r.serverUs, r.clientUs))
	}
	if r.p50ms != 0 || r.p99ms != 0 {
		parts = append(parts, fmt.Sprintf("p50 %8.2f ms  p99 %8.2f ms", r.p50ms, r.p99ms))
	}
	return strings.Join(parts, "  ")
}

// percentile returns the p-quantile (0..1) of xs, interpolating linearly
// between the closest ranks, so small samples (a scaled-down run) still give
// a stable p99 instead of jumping between the two largest values.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	pos := p * float64(len(s)-1)
	lo := int(math.Floor(pos))
	hi := int(math.Ceil(pos))
	return s[lo] + (s[hi]-s[lo])*(pos-float64(lo))
}

// median of the repeats: robust against the one run a checkpoint or an
// autovacuum landed in.
func median(xs []float64) float64 { return percentile(xs, 0.5) }

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// countdown counts events (handled messages, written acks) and closes done
// when the count reaches target, so waiters block on a channel instead of
// polling a counter on a 2-core machine that the benchmark itself loads.
type countdown struct {
	n      atomic.Int64
	target int64
	once   sync.Once
	done   chan struct{}
}

func newCountdown(target int) *countdown {
	return &countdown{target: int64(target), done: make(chan struct{})}
}

func (c *countdown) add(d int64) {
	if c.n.Add(d) >= c.target {
		c.once.Do(func() { close(c.done) })
	}
}

func (c *countdown) count() int64 { return c.n.Load() }

// wait blocks until the target is reached, failed is closed (a consumer
// broke), ctx ends or timeout passes.
func (c *countdown) wait(ctx context.Context, timeout time.Duration, what string, failed <-chan struct{}) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-c.done:
		return nil
	case <-failed:
		return fmt.Errorf("consumer failed after %d of %d %s", c.count(), c.target, what)
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return fmt.Errorf("timed out after %s: %d of %d %s", timeout, c.count(), c.target, what)
	}
}
