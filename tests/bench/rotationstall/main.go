// Command rotationstall measures how long claims of a rotating outbox wait
// behind the rotators' TRUNCATE attempts while a transaction that read the
// outbox stays open (it holds the partition the ring would empty next),
// with a given number of Subscribers. A probe that locks every partition,
// as a claim does, runs every 5 ms meanwhile; the figure is the share of
// the time spent in probes that waited over 10 ms.
//
//	cd tests/bench && go run ./rotationstall -subs 12 -window 3s
//
// It drops and creates the schema bench_rotation_stall of the database
// -dsn names (default $POSTGRES_DSN).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

func main() {
	subs := flag.Int("subs", 1, "Subscribers, each of a consumer group of its own, in this process")
	window := flag.Duration("window", schema.DefaultRotationWindow, "RotationWindow")
	hold := flag.Duration("hold", 10*time.Second, "how long the reading transaction stays open while the probe runs")
	dsn := flag.String("dsn", os.Getenv("POSTGRES_DSN"), "the database (default $POSTGRES_DSN)")
	flag.Parse()
	if err := run(*dsn, *subs, *window, *hold); err != nil {
		fmt.Fprintln(os.Stderr, "rotationstall:", err)
		os.Exit(1)
	}
}

func run(dsn string, subs int, window, hold time.Duration) error {
	if subs < 1 || window <= 0 || hold <= 0 {
		return fmt.Errorf("-subs, -window and -hold must be positive")
	}
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return err
	}
	// A few connections a Subscriber (claims, acks, rotation steps) and
	// the reading transaction's: a smaller pool would make claims wait
	// for connections, not for the TRUNCATE's lock.
	cfg.MaxConns = int32(3*subs + 4)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	tables := schema.Config{Schema: "bench_rotation_stall", Rotating: true}
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS bench_rotation_stall CASCADE`); err != nil {
		return err
	}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	var groups []string
	for i := range subs {
		groups = append(groups, fmt.Sprintf("g%d", i))
	}
	if _, err := pgoutbox.BindGroups(ctx, tx.FromPgxPool(pool), tables, "t", groups); err != nil {
		return err
	}
	for _, g := range groups {
		s, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables, ConsumerGroup: g, RotationWindow: window}, watermill.NopLogger{})
		if err != nil {
			return err
		}
		defer s.Close()
		ch, err := s.Subscribe(ctx, "t")
		if err != nil {
			return err
		}
		go func() {
			for m := range ch {
				m.Ack()
			}
		}()
	}
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables}, nil)
	if err != nil {
		return err
	}
	// Four windows of traffic: every partition of the ring is written.
	for range 40 {
		if err := pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
			return err
		}
		time.Sleep(window / 10)
	}
	time.Sleep(window)
	holder, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer holder.Rollback(ctx) //nolint:errcheck
	var n int
	if err := holder.QueryRow(ctx, `SELECT count(*) FROM bench_rotation_stall.outbox`).Scan(&n); err != nil {
		return err
	}
	probe, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer probe.Close()
	stop := make(chan struct{})
	defer close(stop)
	go func() { // traffic goes on, 20 messages a second
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
				_ = pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("x")))
			}
		}
	}()
	time.Sleep(3 * window) // the ring reaches the partition it cannot empty
	var waits []time.Duration
	for end := time.Now().Add(hold); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		t0 := time.Now()
		var x int
		if err := probe.QueryRow(ctx, `SELECT count(*) FROM bench_rotation_stall.outbox WHERE id < 0`).Scan(&x); err != nil {
			return err
		}
		waits = append(waits, time.Since(t0))
	}
	slices.Sort(waits)
	var blocked time.Duration
	for _, w := range waits {
		if w > 10*time.Millisecond {
			blocked += w
		}
	}
	fmt.Printf("subs=%d window=%s: %d probes, p50 %s, p90 %s, max %s; time in probes that waited over 10 ms: %.0f%% of %s\n",
		subs, window, len(waits), waits[len(waits)/2].Round(time.Millisecond), waits[len(waits)*9/10].Round(time.Millisecond),
		waits[len(waits)-1].Round(time.Millisecond), 100*blocked.Seconds()/hold.Seconds(), hold)
	return nil
}
