package pgoutbox

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// A publisher is built per transaction: the PublishHook field must not
// move it into a larger allocation size class than the 128 bytes it had
// without it.
func TestPublisherStaysInItsSizeClass(t *testing.T) {
	t.Parallel()
	require.LessOrEqual(t, unsafe.Sizeof(Publisher{}), uintptr(128))
}
