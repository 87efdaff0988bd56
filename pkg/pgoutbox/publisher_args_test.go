package pgoutbox

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
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
