package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Redelivered: what the subscriber delivers again whatever a middleware
// does with the error, wrapped as Watermill's middlewares and
// tx.Middleware wrap it; not a handler's own failure or a rejection.
func TestRedelivered(t *testing.T) {
	msg := message.NewMessage("1", nil)
	for _, c := range []struct {
		err  error
		want bool
	}{
		{context.Canceled, true},
		{fmt.Errorf("update orders: %w", context.Canceled), true},
		{backoff.Permanent(tx.ErrLeaseLost), true},
		{errors.Join(errors.New("retry"), tx.ErrLeaseLost), true},
		{errors.New("inventory unavailable"), false},
		{context.DeadlineExceeded, false},
		{Reject(msg, "no such order"), false},
		{nil, false},
	} {
		require.Equal(t, c.want, Redelivered(c.err), "%v", c.err)
	}
}
