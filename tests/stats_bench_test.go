package tests

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// BenchmarkStats times Stats on an outbox of 1,000,000 rows (20 topics x
// 3 groups; 80% ready, 14% scheduled, 20% leased of which half expired,
// some parked; 200-byte payloads) and 20,000 dead letters, after ANALYZE
// and no VACUUM (the visibility map is empty: the worst case for the
// index-only scans). Filling takes a while:
//
//	go test -run '^$' -bench Stats -benchtime 20x ./tests/
func BenchmarkStats(bm *testing.B) {
	b := setup(bm)
	ctx := context.Background()
	b.exec(bm, `
INSERT INTO %s.outbox (topic, consumer_group, uuid, payload, metadata, available_at, lease_token, leased_until)
SELECT 'topic-' || (g % 20), 'g' || (g % 3), g::text, convert_to(repeat('x', 200), 'UTF8'), '{}',
       CASE WHEN g % 7 = 0 THEN now() + interval '1 hour' WHEN g % 1001 = 0 THEN 'infinity' ELSE now() - interval '1 minute' END,
       CASE WHEN g % 5 = 0 THEN gen_random_uuid() END,
       CASE WHEN g % 5 = 0 THEN now() + CASE WHEN g % 10 = 0 THEN interval '1 minute' ELSE -interval '1 minute' END END
  FROM generate_series(1, 1000000) g`)
	b.addDeadLetters(bm, 2_000_000, 20000, "topic-1", "g1", "rejected", 0)
	b.exec(bm, `ANALYZE %s.outbox`)
	b.exec(bm, `ANALYZE %s.outbox_dlq`)
	exec := tx.FromPgxPool(b.Pool)
	for _, c := range []struct {
		name string
		opts []pgoutbox.StatsOption
	}{
		{"all", nil},
		{"topic", []pgoutbox.StatsOption{pgoutbox.StatsForTopic("topic-3")}},
		{"group", []pgoutbox.StatsOption{pgoutbox.StatsForGroup("topic-3", "g1")}},
	} {
		bm.Run(c.name, func(bm *testing.B) {
			for bm.Loop() {
				s, err := pgoutbox.Stats(ctx, exec, b.tables, c.opts...)
				require.NoError(bm, err)
				require.NotEmpty(bm, s)
			}
		})
	}
}
