package tests

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Through the simple protocol (what docs/operations.md sets behind
// PgBouncer) timestamps travel as text in the session's DateStyle, and
// pgx reads only ISO: with a role's or database's DateStyle of 'SQL, DMY'
// every claim failed to scan its rows, for good, and nothing was
// delivered. The subscriber's statements set ISO for themselves, on every
// claim mode; an operator call (Peek) says what to set.
func TestAGermanDateStyleThroughTheSimpleProtocol(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		ctx := context.Background()
		pool := b.poolWith(t, map[string]string{"DateStyle": "SQL, DMY"}, func(c *pgxpool.Config) {
			c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		})
		var style string
		require.NoError(t, pool.QueryRow(ctx, "SHOW DateStyle").Scan(&style))
		require.Equal(t, "SQL, DMY", style)

		pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("dates", newMsgs(3)...))
		_, err = pgoutbox.Peek(ctx, tx.FromPgxPool(pool), b.tables, "dates", "", 10)
		require.ErrorContains(t, err, "set DateStyle=ISO in the DSN", "an operator call on such a pool says what to do")
		// Stats reads the paused groups' times once one is paused: the same.
		require.NoError(t, pgoutbox.PauseGroup(ctx, tx.FromPgxPool(b.Pool), b.tables, "dates", "elsewhere"))
		_, err = pgoutbox.Stats(ctx, tx.FromPgxPool(pool), b.tables)
		require.ErrorContains(t, err, "set DateStyle=ISO in the DSN")
		_, err = pgoutbox.ResumeGroup(ctx, tx.FromPgxPool(b.Pool), b.tables, "dates", "elsewhere")
		require.NoError(t, err)

		sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, ClaimMode: mode,
			MinPollInterval: 20 * time.Millisecond, MaxPollInterval: 200 * time.Millisecond}, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		ch, err := sub.Subscribe(ctx, "dates")
		require.NoError(t, err)
		for range 3 {
			receive(t, ch, 10*time.Second).Ack()
		}
	})
}

// The same for bytea: through the simple protocol a payload travels as
// text in the session's bytea_output, and pgx reads only hex. A role's
// 'escape' (legacy applications set it) failed every claim ("invalid hex
// format"), for good. The subscriber's statements set hex for themselves;
// Peek says what to set.
func TestAnEscapeByteaOutputThroughTheSimpleProtocol(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		ctx := context.Background()
		pool := b.poolWith(t, map[string]string{"bytea_output": "escape"}, func(c *pgxpool.Config) {
			c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		})
		pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
		require.NoError(t, err)
		sent := newMsgs(3)
		require.NoError(t, pub.Publish("bytes", sent...))
		_, err = pgoutbox.Peek(ctx, tx.FromPgxPool(pool), b.tables, "bytes", "", 10)
		require.ErrorContains(t, err, "ALTER ROLE ... SET bytea_output = 'hex'", "an operator call on such a pool says what to do")

		sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, ClaimMode: mode,
			MinPollInterval: 20 * time.Millisecond, MaxPollInterval: 200 * time.Millisecond}, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		ch, err := sub.Subscribe(ctx, "bytes")
		require.NoError(t, err)
		for i := range 3 {
			m := receive(t, ch, 10*time.Second)
			require.Equal(t, string(sent[i].Payload), string(m.Payload))
			m.Ack()
		}
	})
}
