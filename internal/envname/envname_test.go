package envname

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestMisspelt(t *testing.T) {
	require.True(t, Misspelt("PGOUTBOX_MAXINFLIGHT", "PGOUTBOX_MAX_IN_FLIGHT"))
	require.True(t, Misspelt("PGOUTBOX_DLQTABLE", "PGOUTBOX_DLQ_TABLE"))
	require.False(t, Misspelt("PGOUTBOX_DLQ_TABLE", "PGOUTBOX_DLQ_TABLE"))
	require.False(t, Misspelt("PGOUTBOX_PG_WAYS", "PGOUTBOX_DLQ_TABLE"))
	require.Equal(t, runtime.GOOS != "windows", Misspelt("pgoutbox_schema", "PGOUTBOX_SCHEMA"), "case alone: read on Windows")
}
