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

// A payload over MaxPayloadBytes fails the whole call, names the limit and
// the field, and writes nothing: through a pool publisher (which commits on
// its own) and in a transaction (which stays usable and commits the rest of
// its work).
func TestPublishPayloadLimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	big := func(n int) *message.Message { return message.NewMessage(watermill.NewUUID(), make([]byte, n)) }

	// The default: 1 MiB.
	pub := b.poolPublisher(t)
	err := pub.Publish("limit", newMsg("ok"), big(pgoutbox.DefaultMaxPayloadBytes+1))
	require.ErrorIs(t, err, pgoutbox.ErrPayloadTooLarge)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidMessage)
	require.ErrorContains(t, err, "message 1: payload is 1048577 bytes, over PublisherConfig.MaxPayloadBytes (1048576)")
	require.ErrorContains(t, err, "NoPayloadLimit, -1, turns the check off")
	require.Equal(t, 1, strings.Count(err.Error(), "pgoutbox:"), err.Error())
	_, err = pub.PublishWithResult("limit", big(pgoutbox.DefaultMaxPayloadBytes+1))
	require.ErrorIs(t, err, pgoutbox.ErrPayloadTooLarge)
	require.NoError(t, pub.Publish("limit", big(pgoutbox.DefaultMaxPayloadBytes)))
	require.Equal(t, 1, b.outboxRows(t, "limit"))

	// A smaller limit, in a database/sql transaction.
	db := b.sqlDB(t)
	sqlTx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	txPub, err := pgoutbox.NewTxPublisher(sqlTx, pgoutbox.PublisherConfig{Tables: b.tables, MaxPayloadBytes: 10}, nil)
	require.NoError(t, err)
	err = txPub.Publish("limit-tx", big(10), big(11))
	require.ErrorIs(t, err, pgoutbox.ErrPayloadTooLarge)
	require.ErrorContains(t, err, "over PublisherConfig.MaxPayloadBytes (10)")
	require.NoError(t, txPub.Publish("limit-tx", big(10)), "the transaction is still usable")
	require.NoError(t, sqlTx.Commit())
	require.Equal(t, 1, b.outboxRows(t, "limit-tx"))

	// -1 disables the check; below -1 is refused.
	unlimited, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables, MaxPayloadBytes: -1}, nil)
	require.NoError(t, err)
	require.NoError(t, unlimited.Publish("limit-off", big(2*pgoutbox.DefaultMaxPayloadBytes)))
	_, err = pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables, MaxPayloadBytes: -2}, nil)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "MaxPayloadBytes is -2")
	require.Error(t, pgoutbox.PublisherConfig{MaxPayloadBytes: -2}.Validate())
}
