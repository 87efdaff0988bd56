package pgoutbox

import (
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
)

// A call whose messages together pass what one statement carries failed
// in pgx after encoding it, closing the connection and with it the
// caller's transaction; it is refused before anything is sent.
func TestPublishArgsRefusesACallOverOneStatementsSize(t *testing.T) {
	t.Parallel()
	big := make([]byte, 64<<20)
	msgs := make([]*message.Message, 16) // 1 GiB
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), big)
	}
	_, err := publishArgs("t", msgs, nil, NoPayloadLimit)
	require.ErrorIs(t, err, ErrInvalidMessage)
	require.ErrorContains(t, err, "split the call")
	_, err = publishArgs("t", msgs[:14], nil, NoPayloadLimit)
	require.NoError(t, err, "896 MiB")
}

// The statements are cached per outbox, but not for every outbox a
// process ever used: a schema per tenant, or per test, grew the cache by
// ~40 KB each, for good.
func TestTheStatementCacheIsBounded(t *testing.T) {
	for i := range 3 * maxCachedOutboxes {
		_, err := queriesForTables(schema.Config{Schema: fmt.Sprintf("tenant_%d", i)}, false)
		require.NoError(t, err)
	}
	n := 0
	queryCache.Range(func(any, any) bool { n++; return true })
	require.LessOrEqual(t, n, maxCachedOutboxes)
	q, err := queriesForTables(schema.Config{Schema: "tenant_0"}, false) // built again
	require.NoError(t, err)
	require.Contains(t, q.Names.QTable, "tenant_0")
}
