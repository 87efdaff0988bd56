package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// The soak scenarios run a steady load for a long time and watch what a
// queue table does under MVCC: publishers each write one message per
// transaction at a steady rate, one consumer (MaxInFlight 16) keeps up,
// and every window prints the messages published and consumed, the
// end-to-end latency (just before the publish's commit to the handler's
// start, on this process's clock), the backlog, and the outbox's size and
// dead tuples as pgoutbox.Health reports them. Variants add what holds
// vacuum back or changes the claim's view of the table: a REPEATABLE READ
// transaction on another connection holding its snapshot for the whole run
// (blocked), and one message due in an hour, published first and present
// throughout (timer). They need autovacuum on: with it off the table only
// grows and the run measures the server's setting, not the queue.

// soakSystems: the library on its default path and on leases alone.
var soakSystems = []string{"pgoutbox", pgoutboxLeaseName, pgoutboxRingName, rotatingName, generationsName}

// explicitScenarios are only run when named in -scenarios: the soaks, and
// the rotating layout's drain and publish beside pgoutbox's (rotating.go).
var explicitScenarios = []*scenario{
	{name: "drain-16-rotating", systems: []string{"pgoutbox", pgoutboxRingName, rotatingName, generationsName}, explicit: true, run: drainScenario(false, 16)},
	{name: "publish-100-rotating", systems: []string{"pgoutbox", pgoutboxRingName, rotatingName, generationsName}, explicit: true, run: publishScenario(100)},
	{name: "soak", systems: soakSystems, explicit: true, run: soakScenario(false, false)},
	{name: "soak-blocked", systems: soakSystems, explicit: true, run: soakScenario(true, false)},
	// Not on the two experiments: a scheduled publish uses the dedup index's
	// ON CONFLICT, which their partitioned index cannot match.
	{name: "soak-timer", systems: soakSystems[:3], explicit: true, run: soakScenario(false, true)},
	{name: "soak-blocked-timer", systems: soakSystems[:3], explicit: true, run: soakScenario(true, true)},
	// A keyed backlog drained while a snapshot is held elsewhere: each
	// key's check for an older row passes the key's rows consumed since.
	{name: "keyed-100-16-blocked", systems: []string{"pgoutbox", pgoutboxLeaseName, pgoutboxRingName}, explicit: true, run: keyedDrain(100, 16, true)},
	{name: "unkeyed-work-16-blocked", systems: []string{"pgoutbox", pgoutboxLeaseName, pgoutboxRingName}, explicit: true, run: keyedDrain(0, 16, true)},
}

// soakOptions are the soak scenarios' flags.
type soakOptions struct {
	duration, window time.Duration
	rate             float64
	publishers       int
	noAutovacuum     bool
}

func (o soakOptions) problems() []string {
	var p []string
	if o.duration <= 0 {
		p = append(p, "-soak-duration must be positive")
	}
	if o.window <= 0 || o.window > o.duration {
		p = append(p, "-soak-window must be positive and at most -soak-duration")
	}
	if o.rate <= 0 {
		p = append(p, "-soak-rate must be positive")
	}
	if o.publishers < 1 {
		p = append(p, "-soak-publishers must be at least 1")
	}
	return p
}

// checkSoak prints whether the server runs autovacuum, and refuses the
// soak scenarios without it unless -soak-allow-no-autovacuum is set.
func (b *bench) checkSoak(ctx context.Context, w io.Writer) error {
	if !slices.ContainsFunc(b.opts.scenarios, func(s string) bool { return strings.HasPrefix(s, "soak") }) {
		return nil
	}
	var on bool
	if err := b.pool.QueryRow(ctx, `SELECT current_setting('autovacuum')::bool`).Scan(&on); err != nil {
		return fmt.Errorf("read setting autovacuum: %w", err)
	}
	o := b.opts.soak
	fmt.Fprintf(w, "soak: autovacuum=%s  %.0f msg/s from %d publishers (one message per transaction), MaxInFlight 16, %s windows, %s per run\n\n",
		map[bool]string{true: "on", false: "off"}[on], o.rate, o.publishers, o.window, o.duration)
	if !on && !o.noAutovacuum {
		return errors.New("the soak scenarios need a server with autovacuum on, and this one has it off (what they measure is vacuum keeping up): " +
			"run scripts/soak-cluster.sh and export the POSTGRES_DSN it prints, or on a throwaway server run " +
			"ALTER SYSTEM SET autovacuum = on; SELECT pg_reload_conf(); -soak-allow-no-autovacuum runs them anyway")
	}
	return nil
}

// soakWindow is what one window saw.
type soakWindow struct {
	published, consumed int64
	p50, p99, maxMs     float64
	backlog             int64
	health              pgoutbox.HealthReport
	healthErr           error
}

func soakScenario(blocked, timer bool) func(context.Context, *bench, instance) (result, error) {
	return func(ctx context.Context, b *bench, inst instance) (result, error) {
		var pi *pgoutboxInstance
		switch i := inst.(type) {
		case *pgoutboxInstance:
			pi = i
		case *rotatingInstance:
			pi = i.pgoutboxInstance
		}
		if pi == nil {
			return result{}, fmt.Errorf("the soak scenarios run pgoutbox systems only (they read pgoutbox.Health)")
		}
		o := b.opts.soak
		var (
			mu        sync.Mutex
			committed = map[string]time.Time{}
			window    []float64 // latencies of the current window, ms
			all       []float64
			published atomic.Int64
			consumed  atomic.Int64
			want      atomic.Int64 // set when publishing ends: consumed must reach it
			drained   = make(chan struct{})
			drainOnce sync.Once
		)
		if timer {
			// Due in an hour: present for the whole run, never consumed.
			msgs := newMessages(1, newPayload())
			pgoutbox.DeliverAfter(msgs[0], time.Hour)
			t, err := b.pool.Begin(ctx)
			if err != nil {
				return result{}, err
			}
			if err := inst.publish(ctx, t, msgs); err != nil {
				_ = t.Rollback(context.Background())
				return result{}, fmt.Errorf("publish the timer: %w", err)
			}
			if err := t.Commit(ctx); err != nil {
				return result{}, err
			}
		}
		cons, err := inst.consumer(ctx, consumeConfig{
			maxInFlight: 16,
			acks:        math.MaxInt32, // the run ends when consumed catches up, not on a count of acks
			handle: func(uuid string) error {
				now := time.Now()
				mu.Lock()
				t0, ok := committed[uuid]
				delete(committed, uuid)
				if ok {
					window = append(window, ms(now.Sub(t0)))
				}
				mu.Unlock()
				if !ok {
					return fmt.Errorf("message %s handled before its commit was recorded, or twice", uuid)
				}
				if n := consumed.Add(1); n == want.Load() {
					drainOnce.Do(func() { close(drained) })
				}
				return nil
			},
		})
		if err != nil {
			return result{}, err
		}
		defer cons.close()
		if err := cons.start(ctx); err != nil {
			return result{}, err
		}

		if blocked {
			release, err := b.holdSnapshot(ctx)
			if err != nil {
				return result{}, err
			}
			defer release()
		}

		conns := make([]*pgx.Conn, o.publishers)
		for i := range conns {
			c, err := b.conn(ctx)
			if err != nil {
				return result{}, err
			}
			defer c.Close(context.Background())
			conns[i] = c
		}
		pubCtx, stopPublishing := context.WithCancel(ctx)
		defer stopPublishing()
		every := time.Duration(float64(time.Second) * float64(o.publishers) / o.rate)
		begin := time.Now()
		end := begin.Add(o.duration)
		tick := time.NewTicker(o.window)
		defer tick.Stop()
		payload := newPayload()
		errs := make(chan error, o.publishers)
		for i, conn := range conns {
			// Staggered, so the publishers do not commit in bursts.
			offset := every * time.Duration(i) / time.Duration(o.publishers)
			go func() {
				for k := 0; ; k++ {
					at := begin.Add(offset + time.Duration(k)*every)
					if !at.Before(end) {
						errs <- nil
						return
					}
					// Paced against the start, so a slow commit does not
					// push every later message back.
					if !sleepCtx(pubCtx, time.Until(at)) {
						errs <- pubCtx.Err()
						return
					}
					msgs := newMessages(1, payload)
					t, err := conn.Begin(pubCtx)
					if err == nil {
						if err = inst.publish(pubCtx, t, msgs); err != nil {
							_ = t.Rollback(context.Background())
						}
					}
					if err != nil {
						errs <- fmt.Errorf("publish: %w", err)
						return
					}
					mu.Lock()
					committed[msgs[0].UUID] = time.Now()
					mu.Unlock()
					if err := t.Commit(pubCtx); err != nil {
						errs <- fmt.Errorf("commit: %w", err)
						return
					}
					published.Add(1)
				}
			}()
		}

		exec := tx.FromPgxPool(b.pool)
		var windows []soakWindow
		var lastPublished, lastConsumed int64
		running := o.publishers
		fmt.Fprintf(b.progress, "  %-6s %9s %9s %9s %9s %9s %8s %10s %10s %10s %8s  %s\n", "window", "published", "consumed", "p50 ms", "p99 ms", "max ms",
			"backlog", "table", "indexes", "n_dead_tup", "oldest", "last autovacuum")
		nWindows := int(math.Ceil(float64(o.duration) / float64(o.window)))
		for n := 1; n <= nWindows; {
			select {
			case <-ctx.Done():
				return result{}, ctx.Err()
			case <-cons.failed():
				return result{}, withCause(errors.New("consumer failed"), cons)
			case err := <-errs:
				running--
				if err != nil {
					return result{}, err
				}
				continue
			case <-tick.C:
			}
			mu.Lock()
			lat := window
			window = nil
			mu.Unlock()
			all = append(all, lat...)
			w := soakWindow{p50: percentile(lat, 0.5), p99: percentile(lat, 0.99), maxMs: percentile(lat, 1)}
			p, c := published.Load(), consumed.Load()
			w.published, w.consumed, w.backlog = p-lastPublished, c-lastConsumed, max(0, p-c)
			lastPublished, lastConsumed = p, c
			w.health, w.healthErr = pgoutbox.Health(ctx, exec, pi.tables)
			windows = append(windows, w)
			printSoakWindow(b.progress, n, w)
			n++
		}
		for ; running > 0; running-- {
			if err := <-errs; err != nil {
				return result{}, err
			}
		}
		elapsed := time.Since(begin)

		// Publishing is over: the consumer catches up.
		total := published.Load()
		want.Store(total)
		if consumed.Load() >= total {
			drainOnce.Do(func() { close(drained) })
		}
		drainStart := time.Now()
		select {
		case <-drained:
		case <-cons.failed():
			return result{}, withCause(errors.New("consumer failed"), cons)
		case <-ctx.Done():
			return result{}, ctx.Err()
		case <-time.After(2 * time.Minute):
			return result{}, fmt.Errorf("the consumer did not catch up within 2 minutes of the end: %d of %d consumed", consumed.Load(), total)
		}
		catchUp := time.Since(drainStart)
		if err := cons.close(); err != nil {
			return result{}, err
		}
		final, err := pgoutbox.Health(ctx, exec, pi.tables)
		if err != nil {
			return result{}, err
		}

		var p99s []float64
		var maxBacklog int64
		for _, w := range windows {
			if w.consumed > 0 {
				p99s = append(p99s, w.p99)
			}
			maxBacklog = max(maxBacklog, w.backlog)
		}
		summary := fmt.Sprintf("median window p99 %.1f ms, worst window p99 %.1f ms, max backlog %d, caught up %s after the end, "+
			"final outbox %s + %s indexes, n_dead_tup %d", median(p99s), percentile(p99s, 1), maxBacklog, catchUp.Round(time.Millisecond),
			bytesMB(final.Outbox.TableBytes), bytesMB(final.Outbox.IndexBytes), final.Outbox.DeadTuples)
		fmt.Fprintf(b.progress, "  summary: %s\n", summary)
		return result{
			msgsPerS: float64(consumed.Load()) / elapsed.Seconds(),
			p50ms:    percentile(all, 0.5),
			p99ms:    percentile(all, 0.99),
			note:     summary,
		}, nil
	}
}

func printSoakWindow(w io.Writer, n int, s soakWindow) {
	table, indexes, dead, oldest, av := "?", "?", "?", "?", "?"
	if s.healthErr == nil {
		h := s.health
		table, indexes, dead = bytesMB(h.Outbox.TableBytes), bytesMB(h.Outbox.IndexBytes), fmt.Sprint(h.Outbox.DeadTuples)
		oldest = "-"
		if o, ok := h.OldestSnapshot(); ok {
			oldest = o.Age.Round(100 * time.Millisecond).String()
		}
		av = "never"
		if t := h.Outbox.LastAutovacuum; !t.IsZero() {
			av = time.Since(t).Round(time.Second).String() + " ago"
		}
	}
	fmt.Fprintf(w, "  %-6d %9d %9d %9.2f %9.2f %9.2f %8d %10s %10s %10s %8s  %s\n", n, s.published, s.consumed, s.p50, s.p99, s.maxMs,
		s.backlog, table, indexes, dead, oldest, av)
	if s.healthErr != nil {
		fmt.Fprintf(w, "  (health: %v)\n", s.healthErr)
	}
}

// bytesMB formats a size in MB with one decimal.
func bytesMB(n int64) string { return fmt.Sprintf("%.1f MB", float64(n)/(1<<20)) }
