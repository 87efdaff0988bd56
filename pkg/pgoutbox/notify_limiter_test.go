package pgoutbox

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

func TestNotifyLimiterSpacesNotifiesPerTopic(t *testing.T) {
	t.Parallel()
	channel := "c-" + uuid.NewString() // the record is process-wide: a key of this test's own
	l := notifyLimiter{cooldown: 50 * time.Millisecond}
	require.True(t, l.allow(channel, "a"), "the first publish notifies")
	require.False(t, l.allow(channel, "a"), "within the cooldown: quiet")
	require.True(t, l.allow(channel, "b"), "another topic has its own cooldown")
	require.Eventually(t, func() bool { return l.allow(channel, "a") }, time.Second, 5*time.Millisecond,
		"after the cooldown a publish notifies again")

	always := notifyLimiter{cooldown: -1}
	require.True(t, always.allow(channel, "a"))
	require.True(t, always.allow(channel, "a"))
}
