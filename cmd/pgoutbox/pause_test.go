package main

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// pause stops the group's consumption and shows in stats; resume wakes it.
func TestPauseResume(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	out, errOut, code := cliRun(t, env, "pause", "--topic", "orders", "--group", "")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "paused group (default) of topic \"orders\"")
	publish(t, env, "orders", "a", "b")

	out, errOut, code = cliRun(t, env, "stats", "--json")
	require.Equal(t, 0, code, errOut)
	var stats []statsJSON
	require.NoError(t, json.Unmarshal([]byte(out), &stats), out)
	require.Len(t, stats, 1)
	require.True(t, stats[0].Paused)
	require.EqualValues(t, 2, stats[0].Ready)
	out, _, _ = cliRun(t, env, "stats")
	require.Contains(t, out, "PAUSED")

	msgs, err := env.Subscriber.Subscribe(t.Context(), "orders")
	require.NoError(t, err)
	select {
	case m := <-msgs:
		t.Fatalf("a paused group received %s", m.Payload)
	case <-time.After(300 * time.Millisecond):
	}
	out, errOut, code = cliRun(t, env, "resume", "--topic", "orders", "--group", "")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "resumed group (default)")
	pgoutboxtest.Collect(t, msgs, 2, 10*time.Second)

	out, errOut, code = cliRun(t, env, "resume", "--topic", "orders")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "was not paused")
	_, errOut, code = cliRun(t, env, "pause")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "--topic is required")
}
