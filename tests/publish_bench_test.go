package tests

import (
	"context"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// BenchmarkPublish publishes batches of 100 messages of 200 bytes, one
// transaction each (the full comparison lives in tests/bench):
// go test -run '^$' -bench Publish ./tests/
func BenchmarkPublish(bm *testing.B) {
	b := setup(bm)
	ctx := context.Background()
	payload := []byte(strings.Repeat("x", 200))
	for bm.Loop() {
		msgs := make([]*message.Message, 100)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
		}
		pgTx, err := b.Pool.Begin(ctx)
		require.NoError(bm, err)
		pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
		require.NoError(bm, err)
		require.NoError(bm, pub.Publish("bench", msgs...))
		require.NoError(bm, pgTx.Commit(ctx))
	}
	bm.ReportMetric(float64(100*bm.N)/bm.Elapsed().Seconds(), "msgs/s")
}
