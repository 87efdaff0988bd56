package tests

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// ack runs the subscriber's ack statement for (id, token) pairs and
// returns the pairs it deleted.
func ack(t *testing.T, b *bundle, names query.Names, ids []int64, tokens []uuid.UUID) map[int64]uuid.UUID {
	t.Helper()
	toks := make(query.Tokens, len(tokens))
	for i := range tokens {
		toks[i] = &pgtype.UUID{Bytes: tokens[i], Valid: true}
	}
	stmt, args := query.Build(names, true).Write(query.CompleteArgs{AckIDs: ids, AckTokens: toks})
	// As the completer runs it: after the write settings, whose plan is
	// the one these tests are about.
	batch := &pgx.Batch{}
	batch.Queue(query.WriteSettings)
	batch.Queue(stmt, args...)
	res := b.Pool.SendBatch(context.Background(), batch)
	defer func() { require.NoError(t, res.Close()) }()
	_, err := res.Exec()
	require.NoError(t, err)
	rows, err := res.Query()
	require.NoError(t, err)
	defer rows.Close()
	got := map[int64]uuid.UUID{}
	for rows.Next() {
		var id int64
		var token uuid.UUID
		require.NoError(t, rows.Scan(&id, &token))
		got[id] = token
	}
	require.NoError(t, rows.Err())
	return got
}

// An ack deletes the rows it names under their tokens and nothing else,
// on a partitioned outbox too, where two partitions' rows share a ctid
// (an earlier ack, which deleted the versions it found by ctid, deleted
// both).
func TestAckDeletesOnlyItsRowsOnAPartitionedOutbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	parted := partitionedOutbox(t, b, "_ackparted")
	// The first row of each partition: both at ctid (0,1). One leased
	// under ours, one under another consumer's token.
	ours, theirs := uuid.New(), uuid.New()
	var mine, other int64
	require.NoError(t, b.Pool.QueryRow(ctx, `INSERT INTO `+parted+`.outbox (topic, uuid, payload, lease_token, leased_until)
VALUES ('t', 'a', '\x00', $1, now() + interval '1 minute') RETURNING id`, ours).Scan(&mine))
	require.NoError(t, b.Pool.QueryRow(ctx, `INSERT INTO `+parted+`.outbox (topic, uuid, payload, lease_token, leased_until, stored_at)
VALUES ('t', 'b', '\x00', $1, now() + interval '1 minute', '1999-01-01') RETURNING id`, theirs).Scan(&other))
	var sameCtid bool
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(DISTINCT ctid) = 1 FROM `+parted+`.outbox`).Scan(&sameCtid))
	require.True(t, sameCtid, "the two rows share a ctid, in two partitions")

	names, err := query.NewNames(parted, "outbox", "")
	require.NoError(t, err)
	require.Equal(t, map[int64]uuid.UUID{mine: ours}, ack(t, b, names, []int64{mine}, []uuid.UUID{ours}))
	left := column[int64](t, b, `SELECT id FROM `+parted+`.outbox`)
	require.Equal(t, []int64{other}, left, "the other partition's row at the same ctid stays")
}

// An ack whose row changes hands while it waits for the row's lock (a
// competitor takes the expired lease over, or the row moves to another
// group) deletes nothing: the version it deletes is checked again for its
// id and token.
func TestAckDeletesNothingOfARowThatChangedHandsWhileItWaited(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	names := b.names(t)
	tbl := b.Schema + ".outbox"
	for _, change := range []string{"lease_token = gen_random_uuid()", "lease_token = NULL, consumer_group = 'other'"} {
		t.Run(change, func(t *testing.T) {
			token := uuid.New()
			var id int64
			require.NoError(t, b.Pool.QueryRow(ctx, `INSERT INTO `+tbl+` (topic, uuid, payload, lease_token, leased_until)
VALUES ('t', $2, '\x00', $1, now() - interval '1 second') RETURNING id`, token, uuid.NewString()).Scan(&id))

			locker, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = locker.Rollback(context.Background()) }()
			_, err = locker.Exec(ctx, `SELECT 1 FROM `+tbl+` WHERE id = $1 FOR UPDATE`, id)
			require.NoError(t, err)

			acked := make(chan map[int64]uuid.UUID, 1)
			go func() { acked <- ack(t, b, names, []int64{id}, []uuid.UUID{token}) }()
			// The ack has read the row under our token and waits for its lock.
			require.Eventually(t, func() bool {
				var waiting bool
				require.NoError(t, b.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
 WHERE wait_event_type = 'Lock' AND position('DELETE FROM' in query) > 0 AND position($1 in query) > 0)`, b.Schema).Scan(&waiting))
				return waiting
			}, 10*time.Second, 5*time.Millisecond, "the ack waits for the row's lock")
			_, err = locker.Exec(ctx, `UPDATE `+tbl+` SET `+change+` WHERE id = $1`, id)
			require.NoError(t, err)
			require.NoError(t, locker.Commit(ctx))

			require.Empty(t, <-acked, "the ack deletes nothing")
			var present bool
			require.NoError(t, b.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM `+tbl+` WHERE id = $1)`, id).Scan(&present))
			require.True(t, present, "the row that changed hands stays")
		})
	}
}

// A row acked twice in one batch, under the token of an earlier delivery
// and under the one that holds it now (its lease expired and came back to
// the same subscription), is deleted once, and the result names the pair
// that held it; a row another consumer holds stays, whatever the batch's
// tokens.
func TestAckOfARowAckedTwiceInOneBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	names := b.names(t)
	tbl := b.Schema + ".outbox"
	earlier, now, stranger := uuid.New(), uuid.New(), uuid.New()
	twice, other := leasedRow(t, b, now), leasedRow(t, b, stranger)

	got := ack(t, b, names, []int64{twice, twice, other}, []uuid.UUID{earlier, now, earlier})
	require.Equal(t, map[int64]uuid.UUID{twice: now}, got, "deleted under the token that held it")
	left := column[int64](t, b, `SELECT id FROM `+tbl+` WHERE topic = 't'`)
	require.Equal(t, []int64{other}, left, "a row held under a token outside the batch stays")
}

// An ack of an older delivery of a row the subscription holds again under
// a newer token (its lease expired and a claim of its own took it back)
// deletes nothing, even when the batch carries the newer token for
// another row: the newer delivery is still running, and its key must stay
// busy until it ends.
func TestAckOfAnOlderDeliveryLeavesTheNewerOne(t *testing.T) {
	t.Parallel()
	b := setup(t)
	names := b.names(t)
	tbl := b.Schema + ".outbox"
	older, newer := uuid.New(), uuid.New()
	again, other := leasedRow(t, b, newer), leasedRow(t, b, newer)
	got := ack(t, b, names, []int64{again, other}, []uuid.UUID{older, newer})
	require.Equal(t, map[int64]uuid.UUID{other: newer}, got, "only the pair that holds its row")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+tbl+` WHERE id = $1 AND lease_token = $2`, again, newer),
		"the row under its newer delivery stays")
}

// leasedRow stores a message of topic "t" leased under token for a
// minute, and returns its id.
func leasedRow(t *testing.T, b *bundle, token uuid.UUID) int64 {
	t.Helper()
	var id int64
	require.NoError(t, b.Pool.QueryRow(context.Background(), `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, lease_token, leased_until)
VALUES ('t', $2, '\x00', $1, now() + interval '1 minute') RETURNING id`, token, uuid.NewString()).Scan(&id))
	return id
}

// An ack pairs each id with its own token whatever order the batch came
// in (acks arrive in the order handlers finish): the statement finds a
// row's token by a binary search over the ids, which Write sorts first.
// A pair with a token that does not hold its row, in the middle of the
// batch, deletes nothing of that row and does not shift the others.
func TestAckOfPairsInAnyOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	names := b.names(t)
	tbl := b.Schema + ".outbox"
	const n = 60
	ids, tokens := make([]int64, n), make([]uuid.UUID, n)
	for i := range ids {
		tokens[i] = uuid.New()
		ids[i] = leasedRow(t, b, tokens[i])
	}
	// Newest first, then every third pair moved to the front.
	slices.Reverse(ids)
	slices.Reverse(tokens)
	for i := 3; i < n; i += 3 {
		ids[0], ids[i] = ids[i], ids[0]
		tokens[0], tokens[i] = tokens[i], tokens[0]
	}
	wrong := n / 2
	kept, held := ids[wrong], tokens[wrong]
	tokens[wrong] = uuid.New()

	got := ack(t, b, names, slices.Clone(ids), slices.Clone(tokens))
	want := map[int64]uuid.UUID{}
	for i := range ids {
		if i != wrong {
			want[ids[i]] = tokens[i]
		}
	}
	require.Equal(t, want, got, "every pair that holds its row, and only those")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+tbl+` WHERE id = $1 AND lease_token = $2`, kept, held),
		"the row acked under another token stays")
}

// A hold (an ordered subscription's nack, retried by itself) counts the
// next delivery once, also when the completer writes it again because the
// reply of a write that committed was lost: the second write finds the
// count there and leaves it.
func TestHoldWrittenTwiceCountsOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	names := b.names(t)
	token := uuid.New()
	id := leasedRow(t, b, token)
	_, err := b.Pool.Exec(context.Background(), `UPDATE `+b.Schema+`.outbox SET deliveries = 1 WHERE id = $1`, id)
	require.NoError(t, err)
	hold := query.CompleteArgs{
		HoldIDs: []int64{id}, HoldTokens: query.Tokens{&pgtype.UUID{Bytes: token, Valid: true}},
		HoldErrs: []pgtype.Text{{String: "failed", Valid: true}}, HoldMetas: []pgtype.Text{{}},
		HoldCounts: []int32{2}, LeaseUS: time.Minute.Microseconds(), Channel: "pgoutbox_test", WakeKey: "t",
	}
	for range 2 {
		stmt, args := query.Build(names, true).Write(hold)
		var got int64
		require.NoError(t, b.Pool.QueryRow(context.Background(), stmt, args...).Scan(&got, new(uuid.UUID)))
		require.Equal(t, id, got, "the hold keeps the row under its token")
		require.Equal(t, 2, b.count(t, `SELECT deliveries FROM `+b.Schema+`.outbox WHERE id = $1`, id))
	}
}
