package tx

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// A nil function panicked after the transaction had begun.
func TestRunInTxRefusesANilFunction(t *testing.T) {
	t.Parallel()
	err := RunInTx(context.Background(), FromPgxPool(nil), nil)
	require.ErrorContains(t, err, "RunInTx was given a nil function")
}
