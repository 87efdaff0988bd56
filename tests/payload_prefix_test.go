package tests

import (
	"context"
	"crypto/rand"
	"math"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// A list of large messages that shows a preview reads the start of each
// payload, not all of it: PeekPayloadPrefix and DeadLetterFilter.
// PayloadPrefix cut Payload and keep the whole size in PayloadSize, on an
// outbox with arrivals too. The operator's lists (the CLI's tables, the
// UI's pages) read 1 MB dead letters whole to show one line each: a list
// of 300 took 325 MB of the CLI's memory, 10,000 would have read 10 GB.
func TestListsReadPayloadsByPrefix(t *testing.T) {
	t.Parallel()
	for _, arrivals := range []bool{false, true} {
		name := "Outbox"
		if arrivals {
			name = "Arrivals"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			if arrivals {
				b = setupArrivals(t)
			}
			ctx := context.Background()
			exec := tx.FromPgxPool(b.Pool)
			large := make([]byte, 512<<10)
			_, _ = rand.Read(large)
			text := strings.Repeat("ü", 300) // 600 bytes, a cut at an odd byte splits a character
			require.NoError(t, b.poolPublisher(t).Publish("big", message.NewMessage("large", large), message.NewMessage("text", []byte(text)),
				message.NewMessage("empty", nil)))

			whole, err := pgoutbox.Peek(ctx, exec, b.tables, "big", "", 10)
			require.NoError(t, err)
			require.Len(t, whole, 3)
			require.Equal(t, large, whole[0].Payload)
			require.Equal(t, len(large), whole[0].PayloadSize)
			require.Equal(t, len(text), whole[1].PayloadSize)

			cut, err := pgoutbox.Peek(ctx, exec, b.tables, "big", "", 10, pgoutbox.PeekPayloadPrefix(101))
			require.NoError(t, err)
			require.Len(t, cut, 3)
			require.Equal(t, large[:101], cut[0].Payload)
			require.Equal(t, len(large), cut[0].PayloadSize, "the whole size")
			require.Equal(t, []byte(text)[:101], cut[1].Payload)
			require.Equal(t, len(text), cut[1].PayloadSize)
			require.Empty(t, cut[2].Payload)
			require.Zero(t, cut[2].PayloadSize)

			all, err := pgoutbox.Peek(ctx, exec, b.tables, "big", "", 10, pgoutbox.PeekPayloadPrefix(math.MaxInt))
			require.NoError(t, err, "a prefix past any payload's size reads them whole")
			require.Equal(t, large, all[0].Payload)

			_, err = pgoutbox.Peek(ctx, exec, b.tables, "big", "", 10, pgoutbox.PeekPayloadPrefix(-1))
			require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
		})
	}
}

func TestDeadLettersReadPayloadsByPrefix(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	b.addDeadLetters(t, 1, 2, "a", "", "rejected", 0)
	large := make([]byte, 512<<10)
	_, _ = rand.Read(large)
	b.exec(t, `UPDATE %s.outbox_dlq SET payload = $1 WHERE id = 1`, large)

	page, err := pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Topic: "a", PayloadPrefix: 64})
	require.NoError(t, err)
	require.Len(t, page.Letters, 2)
	require.Equal(t, large[:64], page.Letters[0].Payload)
	require.Equal(t, len(large), page.Letters[0].PayloadSize)
	require.Equal(t, "p-2", string(page.Letters[1].Payload), "shorter than the prefix: whole")
	require.Equal(t, 3, page.Letters[1].PayloadSize)

	page, err = pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{})
	require.NoError(t, err)
	require.Equal(t, large, page.Letters[0].Payload, "whole by default")
	require.Equal(t, len(large), page.Letters[0].PayloadSize)
	d, ok, err := pgoutbox.DeadLetterByID(ctx, exec, b.tables, 1)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, large, d.Payload)
	require.Equal(t, len(large), d.PayloadSize)

	page, err = pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{PayloadPrefix: math.MaxInt})
	require.NoError(t, err)
	require.Equal(t, large, page.Letters[0].Payload)

	_, err = pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{PayloadPrefix: -1})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
}

// What a prefix saves is the server's reading of the stored payload (its
// TOAST chunks), not only the bytes sent: the table's TOAST block reads,
// counted by the statistics, for a Peek of a 512 KiB payload whole and by
// a 1 KiB prefix.
func TestPeekByPrefixReadsOnlyTheStartOfAStoredPayload(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var version int
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version))
	if version < 150000 {
		t.Skip("pg_stat_force_next_flush needs PostgreSQL 15")
	}
	large := make([]byte, 512<<10)
	_, _ = rand.Read(large) // incompressible: stored out of line, in about 260 chunks
	require.NoError(t, b.poolPublisher(t).Publish("big", message.NewMessage("large", large)))

	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	// The statistics of one backend, flushed when it goes idle.
	toastBlocks := func() int64 {
		_, err := conn.Exec(ctx, `SELECT pg_stat_force_next_flush()`)
		require.NoError(t, err)
		_, err = conn.Exec(ctx, `SELECT pg_stat_clear_snapshot()`)
		require.NoError(t, err)
		var n int64
		require.NoError(t, conn.QueryRow(ctx, `SELECT coalesce(toast_blks_hit, 0) + coalesce(toast_blks_read, 0)
  FROM pg_statio_user_tables WHERE schemaname = $1 AND relname = 'outbox'`, b.Schema).Scan(&n))
		return n
	}
	peek := func(opts ...pgoutbox.PeekOption) int64 {
		before := toastBlocks()
		require.NoError(t, pgx.BeginFunc(ctx, conn, func(t2 pgx.Tx) error {
			got, err := pgoutbox.Peek(ctx, tx.FromPgxTx(t2), b.tables, "big", "", 1, opts...)
			require.Len(t, got, 1)
			return err
		}))
		return toastBlocks() - before
	}
	whole := peek()
	prefix := peek(pgoutbox.PeekPayloadPrefix(1 << 10))
	t.Logf("TOAST blocks read: whole payload %d, 1 KiB prefix %d", whole, prefix)
	require.GreaterOrEqual(t, whole, int64(32), "the whole payload is read from its chunks")
	require.Less(t, prefix*8, whole, "a prefix reads a few chunks")
}
