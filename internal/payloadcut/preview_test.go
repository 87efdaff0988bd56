package payloadcut

import (
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestTrim(t *testing.T) {
	whole := []byte("grüße, 世界 \xef\xbf\xbd")
	for n := 0; n <= len(whole); n++ {
		got := Trim(whole[:n], len(whole))
		require.True(t, utf8.Valid(got), "cut at %d: %q", n, got)
		require.GreaterOrEqual(t, len(got), n-(utf8.UTFMax-1), "cut at %d: at most a character's first bytes dropped", n)
	}
	require.Equal(t, whole, Trim(whole, len(whole)), "a whole payload is kept")
	bin := []byte{0xff, 0xfe, 0x80}
	require.Equal(t, bin, Trim(bin, 3), "a whole binary payload is kept as it is")
	require.Equal(t, []byte("ok"), Trim([]byte("ok\xe4\xb8"), 10))
}
