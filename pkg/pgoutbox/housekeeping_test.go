package pgoutbox

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/logbudget"
)

// Deadlines passed together (one stalled batch) make a few error lines a
// window; the next window's first line counts those sent to the debug log.
func TestHousekeepingDeadlineLinesAFewAWindow(t *testing.T) {
	t.Parallel()
	var h housekeeping
	now := time.Now()
	errLines := 0
	for range 40 {
		if h.deadlineLine(now, watermill.LogFields{}) {
			errLines++
		}
	}
	require.Equal(t, logbudget.PerWindow, errLines)
	fields := watermill.LogFields{}
	require.True(t, h.deadlineLine(now.Add(logbudget.Window), fields))
	require.Equal(t, 40-logbudget.PerWindow, fields["debug_lines_since"])
	fields = watermill.LogFields{}
	require.True(t, h.deadlineLine(now.Add(logbudget.Window), fields))
	require.NotContains(t, fields, "debug_lines_since", "counted once")
}
