package pgoutbox

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"
)

// The ring keeps the last maxRecentAcks acks; since gives those written
// from a time on, the newest token of each row (a row acked, delivered
// again and acked again was deleted under the later one).
func TestAckedRingKeepsTheLastAcks(t *testing.T) {
	var r ackedRing
	t0 := time.Now()
	for i := range maxRecentAcks + 10 {
		r.add(ackedRow{id: int64(i), at: t0.Add(time.Duration(i) * time.Microsecond)})
	}
	all := r.since(t0)
	require.Len(t, all, maxRecentAcks)
	require.Equal(t, int64(10), all[0].id, "the oldest ten made room")
	require.Equal(t, int64(maxRecentAcks+9), all[len(all)-1].id)
	require.Len(t, r.since(t0.Add(time.Duration(maxRecentAcks)*time.Microsecond)), 10)

	var again ackedRing
	again.add(ackedRow{id: 7, token: pgtype.UUID{Bytes: [16]byte{1}, Valid: true}, at: t0})
	again.add(ackedRow{id: 8, at: t0})
	again.add(ackedRow{id: 7, token: pgtype.UUID{Bytes: [16]byte{2}, Valid: true}, at: t0})
	got := again.since(t0)
	require.Len(t, got, 2)
	require.Equal(t, int64(7), got[0].id)
	require.Equal(t, byte(2), got[0].token.Bytes[0], "the later ack of row 7")
}
