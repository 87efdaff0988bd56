package pgoutbox

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

func allowed(l notifyLimiter, channel, topic string) bool {
	_, ok := l.allow(channel, topic)
	return ok
}

func TestNotifyLimiterSpacesNotifiesPerTopic(t *testing.T) {
	t.Parallel()
	channel := "c-" + uuid.NewString() // the record is process-wide: a key of this test's own
	l := notifyLimiter{cooldown: 50 * time.Millisecond}
	require.True(t, allowed(l, channel, "a"), "the first publish notifies")
	require.False(t, allowed(l, channel, "a"), "within the cooldown: quiet")
	require.True(t, allowed(l, channel, "b"), "another topic has its own cooldown")
	require.Eventually(t, func() bool { return allowed(l, channel, "a") }, time.Second, 5*time.Millisecond,
		"after the cooldown a publish notifies again")

	always := notifyLimiter{cooldown: -1}
	require.True(t, allowed(always, channel, "a"))
	require.True(t, allowed(always, channel, "a"))
}

func TestNotifyLimiterCancelGivesTheCooldownBack(t *testing.T) {
	t.Parallel()
	channel := "c-" + uuid.NewString()
	l := notifyLimiter{cooldown: time.Hour}
	ticket, ok := l.allow(channel, "a")
	require.True(t, ok)
	ticket.cancel() // the statement failed: nothing was notified
	second, ok := l.allow(channel, "a")
	require.True(t, ok, "after a cancelled notify the next publish notifies")
	require.False(t, allowed(l, channel, "a"))

	ticket.cancel() // a stale ticket must not undo a later record
	require.False(t, allowed(l, channel, "a"), "a stale cancel left the later record alone")
	second.cancel()
	require.True(t, allowed(l, channel, "a"))
}

func TestNotifyLimiterSweepsStaleTopics(t *testing.T) {
	// Not parallel: it fills the process-wide record.
	channel := "c-" + uuid.NewString()
	l := notifyLimiter{cooldown: time.Hour}
	for lastNotifyKeys.Load() < notifyKeysSweepAt {
		allowed(l, channel, uuid.NewString())
	}
	lastNotify.Range(func(_, v any) bool { // age every record
		v.(interface{ Store(int64) }).Store(-int64(time.Hour))
		return true
	})
	sweepMu.Lock()
	lastSweep = 0
	sweepMu.Unlock()
	allowed(l, channel, "one more topic")
	require.Less(t, lastNotifyKeys.Load(), int64(10), "the stale records are gone")
	n := 0
	lastNotify.Range(func(any, any) bool { n++; return true })
	require.Equal(t, int(lastNotifyKeys.Load()), n, "the key count follows the map")
	require.False(t, allowed(l, channel, "one more topic"), "a fresh record stays")
}
