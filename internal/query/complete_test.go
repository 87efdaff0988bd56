package query

import (
	"testing"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"
)

func token(b byte) *pgtype.UUID { return &pgtype.UUID{Bytes: [16]byte{b}, Valid: true} }

// Write sends acks alone through Ack with the ids sorted and each token
// still beside its id, and a batch whose ids repeat through Complete.
func TestWriteSortsAcksByIDWithTheirTokens(t *testing.T) {
	q := Build(Names{QTable: `"s"."outbox"`}, true).CompleteStatements
	a := CompleteArgs{AckIDs: []int64{9, 3, 7, 1}, AckTokens: Tokens{token(9), token(3), token(7), token(1)}}
	stmt, args := q.Write(a)
	require.Equal(t, q.Ack, stmt)
	require.Equal(t, []int64{1, 3, 7, 9}, args[0])
	for i, id := range args[0].([]int64) {
		require.Equal(t, byte(id), args[1].(Tokens)[i].Bytes[0], "the token of id %d", id)
	}

	twice := CompleteArgs{AckIDs: []int64{5, 2, 5}, AckTokens: Tokens{token(1), token(2), token(3)}}
	stmt, _ = q.Write(twice)
	require.Equal(t, q.Complete, stmt, "an id twice goes through the join")
}
