package tests

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// BenchmarkDrain drains a backlog through a Watermill router with a no-op
// handler and reports msgs/s (the full comparison lives in tests/bench):
// go test -run '^$' -bench Drain ./tests/
func BenchmarkDrain(bm *testing.B) {
	for _, inFlight := range []int{1, 16} {
		bm.Run(fmt.Sprintf("inflight-%d", inFlight), func(bm *testing.B) {
			const backlog = 20000
			b := setup(bm, pgoutboxtest.Options{MaxConns: 20})
			ctx := context.Background()
			var total time.Duration
			for bm.Loop() {
				_, err := b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, metadata)
					SELECT 'drain', g::text, convert_to(repeat('x', 200), 'UTF8'), '{"k":"v"}' FROM generate_series(1, $1) g`, backlog)
				require.NoError(bm, err)
				_, err = b.Pool.Exec(ctx, `VACUUM ANALYZE `+b.Schema+`.outbox`)
				require.NoError(bm, err)

				// Done when every ack is written (the rows are gone), which the
				// subscriber reports: no polling of the table.
				var acked atomic.Int64
				done := make(chan struct{})
				sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
					Tables:      b.tables,
					MaxInFlight: inFlight,
					Observer: pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
						if e.Kind == pgoutbox.EventAcked && acked.Add(1) == backlog {
							close(done)
						}
					}),
				}, nil)
				require.NoError(bm, err)
				r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
				require.NoError(bm, err)
				r.AddConsumerHandler("noop", "drain", sub, func(*message.Message) error { return nil })
				start := time.Now()
				go func() { _ = r.Run(ctx) }()
				<-done
				total += time.Since(start)
				require.Equal(bm, 0, b.outboxRows(bm, "drain"))
				require.NoError(bm, r.Close())
			}
			bm.ReportMetric(float64(backlog*bm.N)/total.Seconds(), "msgs/s")
		})
	}
}
