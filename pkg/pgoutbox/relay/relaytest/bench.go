package relaytest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay"
)

// BenchRelay measures the relay: b.N messages wait in a fresh outbox
// (written before the timer starts), and the timer runs until the relay
// emptied it, every message confirmed by the target. It reports msgs/s.
func BenchRelay(b *testing.B, target message.Publisher, targetTopic string, workers, batchSize int) {
	ctx := context.Background()
	pool, tables := Outbox(b, ctx)
	Publish(b, ctx, pool, tables, "orders", b.N)
	r, err := relay.New(pool, target, relay.Config{
		Topics:      []string{"orders"},
		TargetTopic: func(string) string { return targetTopic },
		Workers:     workers,
		BatchSize:   batchSize,
		Subscriber:  pgoutbox.SubscriberConfig{Tables: tables, MinPollInterval: 5 * time.Millisecond, MaxPollInterval: 100 * time.Millisecond},
	})
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan error, 1)
	b.ResetTimer()
	start := time.Now()
	go func() { done <- r.Run(ctx) }()
	for r.Stats().Relayed < int64(b.N) {
		time.Sleep(time.Millisecond) // polling a counter: the timer's resolution, not synchronisation
	}
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
	if err := r.Close(); err != nil {
		b.Fatal(err)
	}
	if err := <-done; err != nil {
		b.Fatal(err)
	}
}

// BenchDirect measures publishing the same messages straight to the
// target, with the relay's concurrency: workers goroutines, each calling
// Publish with batchSize messages at a time. It reports msgs/s.
func BenchDirect(b *testing.B, target message.Publisher, targetTopic string, workers, batchSize int) {
	msgs := make([]*message.Message, b.N)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(`{"event":"OrderPlaced"}`))
	}
	batches := make(chan []*message.Message, b.N/batchSize+1)
	for i := 0; i < len(msgs); i += batchSize {
		batches <- msgs[i:min(i+batchSize, len(msgs))]
	}
	close(batches)
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for batch := range batches {
				if err := target.Publish(targetTopic, batch...); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
}
