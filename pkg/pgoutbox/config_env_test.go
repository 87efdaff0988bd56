package pgoutbox

import (
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
)

func lookupIn(env map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := env[k]
		return v, ok
	}
}

func TestSubscriberConfigFromEnv(t *testing.T) {
	t.Parallel()
	c, err := subscriberConfigFromLookup("APP", nil, lookupIn(map[string]string{
		"APP_SCHEMA":                 "shop",
		"APP_TABLE":                  "events",
		"APP_DLQ_TABLE":              "events_failed",
		"APP_CONSUMER_GROUP":         "billing",
		"APP_MAX_IN_FLIGHT":          "16",
		"APP_LEASE":                  "1m",
		"APP_MIN_POLL_INTERVAL":      "50ms",
		"APP_MAX_POLL_INTERVAL":      "2s",
		"APP_STATEMENT_TIMEOUT":      "5s",
		"APP_DRAIN_TIMEOUT":          "-1",
		"APP_ACK_DEADLINE":           "2m",
		"APP_MAX_DELIVERIES":         "20",
		"APP_SYNCHRONOUS_COMMIT":     "true",
		"APP_CLAIM_MODE":             "Lease",
		"APP_WORKER_ID":              "worker-1",
		"APP_LISTEN_DSN":             "postgres://direct:5432/app",
		"APP_AUTO_INITIALIZE_SCHEMA": "1",
		"APP_RETRY_MAX_ATTEMPTS":     "5",
		"APP_RETRY_INITIAL_INTERVAL": "200ms",
		"APP_RETRY_MAX_INTERVAL":     "1m",
		"APP_RETRY_MULTIPLIER":       "1.5",
		"APP_RETRY_JITTER":           "-1",
		"OTHER_LEASE":                "nonsense", // another prefix: ignored
	}))
	require.NoError(t, err)
	require.Equal(t, SubscriberConfig{
		Tables:        schema.Config{Schema: "shop", Table: "events", DeadLetterTable: "events_failed"},
		ConsumerGroup: "billing", MaxInFlight: 16, Lease: time.Minute,
		MinPollInterval: 50 * time.Millisecond, MaxPollInterval: 2 * time.Second, StatementTimeout: 5 * time.Second,
		DrainTimeout: -1, AckDeadline: 2 * time.Minute, MaxDeliveries: 20, SynchronousCommit: true, ClaimMode: ClaimLease,
		WorkerID: "worker-1", ListenDSN: "postgres://direct:5432/app", AutoInitializeSchema: true,
		RetryPolicy: ExponentialBackoff{MaxAttempts: 5, InitialInterval: 200 * time.Millisecond, MaxInterval: time.Minute, Multiplier: 1.5, Jitter: -1},
	}, c)
}

func TestConfigFromEnvUnsetKeepsDefaults(t *testing.T) {
	t.Parallel()
	c, err := subscriberConfigFromLookup("APP_", nil, lookupIn(map[string]string{"APP_LEASE": "", "APP_TABLE": "  "}))
	require.NoError(t, err)
	require.Equal(t, SubscriberConfig{}, c, "unset and empty variables leave the zero value, whose defaults apply")
	p, err := publisherConfigFromLookup("APP", nil, lookupIn(nil))
	require.NoError(t, err)
	require.Equal(t, PublisherConfig{}, p)
}

func TestConfigFromEnvReportsEveryInvalidValue(t *testing.T) {
	t.Parallel()
	_, err := subscriberConfigFromLookup("APP", nil, lookupIn(map[string]string{
		"APP_LEASE":              "30",
		"APP_MAX_IN_FLIGHT":      "many",
		"APP_SYNCHRONOUS_COMMIT": "sure",
		"APP_DRAIN_TIMEOUT":      "-2s",
		"APP_RETRY_MAX_ATTEMPTS": "-5",
		"APP_RETRY_JITTER":       "2",
		"APP_RETRY_MULTIPLIER":   "0.5",
		"APP_CLAIM_MODE":         "fast",
	}))
	require.Error(t, err)
	require.ErrorIs(t, err, ErrInvalidConfig)
	msg := err.Error()
	for _, want := range []string{
		`APP_LEASE="30" is not valid; use a positive Go duration`,
		`APP_MAX_IN_FLIGHT="many" is not valid; use a whole number`,
		`APP_SYNCHRONOUS_COMMIT="sure" is not valid; use true or false`,
		`APP_DRAIN_TIMEOUT="-2s" is not valid; use a positive Go duration such as 30s, 500ms or 1m30s, or -1 to release`,
		`APP_RETRY_MAX_ATTEMPTS="-5"`,
		`APP_RETRY_JITTER="2" is not valid; use a number from 0 to 1`,
		`APP_RETRY_MULTIPLIER="0.5" is not valid; use 1 or more`,
		`APP_CLAIM_MODE="fast" is not valid; use auto, lease or held`,
	} {
		require.Contains(t, msg, want)
	}

	_, err = publisherConfigFromLookup("APP", nil, lookupIn(map[string]string{
		"APP_NOTIFY_COOLDOWN":   "soon",
		"APP_MAX_PAYLOAD_BYTES": "1MB",
	}))
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), `APP_NOTIFY_COOLDOWN="soon"`)
	require.Contains(t, err.Error(), `APP_MAX_PAYLOAD_BYTES="1MB" is not valid; use a whole number of bytes, or -1 for no limit`)

	// A value that parses but is out of range is reported beside one that
	// does not parse, and a jitter's special value as the variable takes it.
	_, err = publisherConfigFromLookup("APP", nil, lookupIn(map[string]string{
		"APP_NOTIFY_COOLDOWN":   "-3ms",
		"APP_MAX_PAYLOAD_BYTES": "-5",
	}))
	require.Contains(t, err.Error(), `APP_NOTIFY_COOLDOWN="-3ms"`)
	require.Contains(t, err.Error(), `APP_MAX_PAYLOAD_BYTES="-5" is not valid`)
	_, err = subscriberConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_RETRY_JITTER": "1.5", "APP_MAX_DELIVERIES": "-2", "APP_LEASE": "soon"}))
	require.Contains(t, err.Error(), `APP_RETRY_JITTER="1.5" is not valid; use a number from 0 to 1 (0.2 spreads delays by ±20%), or -1 for none`)
	require.Contains(t, err.Error(), `APP_MAX_DELIVERIES="-2" is not valid`)
}

func TestConfigFromEnvValidates(t *testing.T) {
	t.Parallel()
	// 0 is the field's default (1), but in the environment it is a mistake.
	for _, v := range []string{"0", "-1"} {
		_, err := subscriberConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_MAX_IN_FLIGHT": v}))
		require.ErrorIs(t, err, ErrInvalidConfig)
		require.Contains(t, err.Error(), `APP_MAX_IN_FLIGHT="`+v+`" is not valid; use a whole number, at least 1`)
	}
	_, err := subscriberConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_LEASE": "2s", "APP_MAX_POLL_INTERVAL": "5s"}))
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), "the APP_* variables")
	require.Contains(t, err.Error(), "Lease (2s) must be longer than MaxPollInterval (5s)")
	require.Contains(t, err.Error(), "(Lease is APP_LEASE, MaxPollInterval is APP_MAX_POLL_INTERVAL)", "the fields' variables named")

	_, err = publisherConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_TABLE": "bad name"}))
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = publisherConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_DLQ_TABLE": "x", "APP_NO_DLQ": "true"}))
	require.Error(t, err)
}

func TestConfigFromEnvReadsTheEnvironment(t *testing.T) {
	t.Setenv("PGOUTBOX_ENVTEST_LEASE", "45s")
	t.Setenv("PGOUTBOX_ENVTEST_NOTIFY_COOLDOWN", "-1")
	c, err := SubscriberConfigFromEnv("PGOUTBOX_ENVTEST")
	require.NoError(t, err)
	require.Equal(t, 45*time.Second, c.Lease)
	p, err := PublisherConfigFromEnv("PGOUTBOX_ENVTEST")
	require.NoError(t, err)
	require.Equal(t, time.Duration(-1), p.NotifyCooldown)
}

// FuzzSubscriberConfigFromEnv checks that no value panics, that every
// error names a variable, and that a config returned without error
// passes Validate.
func FuzzSubscriberConfigFromEnv(f *testing.F) {
	f.Add("30s", "100ms", "5s", "10s", "1", "worker", "", "outbox", "10", "-1", "1s")
	f.Add("1s", "", "", "", "0", "", "billing", "", "", "", "")
	f.Add("-1", "1h", "1ns", "9223372036854775807ns", "-5", "\x00", "g\x00", "bad name", "-1", "nope", "-1")
	f.Add("2562047h", "0", "0", "0", "99999999999999999999", "w", "x", "a_b", "0", "1e400", "NaN")
	f.Fuzz(func(t *testing.T, lease, minPoll, maxPoll, stmt, inFlight, worker, group, table, attempts, jitter, drain string) {
		env := map[string]string{
			"X_LEASE": lease, "X_MIN_POLL_INTERVAL": minPoll, "X_MAX_POLL_INTERVAL": maxPoll,
			"X_STATEMENT_TIMEOUT": stmt, "X_MAX_IN_FLIGHT": inFlight, "X_WORKER_ID": worker,
			"X_CONSUMER_GROUP": group, "X_TABLE": table, "X_RETRY_MAX_ATTEMPTS": attempts,
			"X_RETRY_JITTER": jitter, "X_DRAIN_TIMEOUT": drain,
		}
		c, err := subscriberConfigFromLookup("X", nil, lookupIn(env))
		if err != nil {
			require.ErrorIs(t, err, ErrInvalidConfig)
			if !strings.Contains(err.Error(), "X_") {
				t.Fatalf("the error names no variable: %v", err)
			}
			return
		}
		require.NoError(t, c.Validate())
		if b, ok := c.RetryPolicy.(ExponentialBackoff); ok {
			// The policy must answer without panicking.
			_, _ = b.NextDelay(1, errors.New("x"))
		}
	})
}

// A variable both configurations read is reported once; the problems of
// each are all there.
func TestConfigFromEnvReportsASharedVariableOnce(t *testing.T) {
	t.Setenv("PGOUTBOX_ENVDUP_SCHEMA", "bad-name")
	_, err := ConfigFromEnv("PGOUTBOX_ENVDUP")
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Equal(t, 1, strings.Count(err.Error(), `"bad-name"`), err.Error())
	// With a problem of the subscriber's own beside it, on the same line.
	t.Setenv("PGOUTBOX_ENVDUP_START_FROM", "oldest")
	_, err = ConfigFromEnv("PGOUTBOX_ENVDUP")
	require.Equal(t, 1, strings.Count(err.Error(), `"bad-name"`), err.Error())
	require.Contains(t, err.Error(), `StartFrom is "oldest"`)
	t.Setenv("PGOUTBOX_ENVDUP_NO_DLQ", "yes")
	_, err = ConfigFromEnv("PGOUTBOX_ENVDUP")
	require.Equal(t, 1, strings.Count(err.Error(), `NO_DLQ="yes"`), err.Error())

	t.Setenv("PGOUTBOX_ENVDUP_LEASE", "ten")
	t.Setenv("PGOUTBOX_ENVDUP_NOTIFY_COOLDOWN", "soon")
	_, err = ConfigFromEnv("PGOUTBOX_ENVDUP")
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), `PGOUTBOX_ENVDUP_LEASE="ten"`)
	require.Contains(t, err.Error(), `PGOUTBOX_ENVDUP_NOTIFY_COOLDOWN="soon"`)
}

// The layout of the outbox is read too: a subscriber without Arrivals
// would never take what arrives, one without Rotating refuses a rotating
// outbox.
func TestConfigFromEnvReadsTheLayout(t *testing.T) {
	t.Parallel()
	sub, err := subscriberConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_ARRIVALS": "true"}))
	require.NoError(t, err)
	require.True(t, sub.Tables.Arrivals)
	pub, err := publisherConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_ARRIVALS": "1"}))
	require.NoError(t, err)
	require.True(t, pub.Tables.Arrivals)

	sub, err = subscriberConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_ROTATING": "true", "APP_ROTATION_WINDOW": "10s"}))
	require.NoError(t, err)
	require.True(t, sub.Tables.Rotating)
	require.Equal(t, 10*time.Second, sub.RotationWindow)
	pub, err = publisherConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_ROTATING": "true"}))
	require.NoError(t, err)
	require.True(t, pub.Tables.Rotating)

	_, err = subscriberConfigFromLookup("APP", nil, lookupIn(map[string]string{"APP_ARRIVALS": "yes please", "APP_ROTATION_WINDOW": "3"}))
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), `APP_ARRIVALS="yes please"`)
	require.Contains(t, err.Error(), `APP_ROTATION_WINDOW="3"`)
}

// A variable of the prefix that is a known one spelt with other
// underscores or case is read by nobody: it left its field at the default
// without a word. It is an error naming the variable meant; the prefix's
// other variables (the application's own) are left alone, and so are the
// other config's (a subscriber's variables beside a publisher's).
func TestConfigFromEnvNamesAMisspeltVariable(t *testing.T) {
	t.Parallel()
	env := map[string]string{"APP_MAXINFLIGHT": "16", "APP_Lease": "1m", "APP_LEASE": "2m", "APP_DATABASE_URL": "postgres://x",
		"APP_MAX_IN_FLIGHT": "8", "APP_NOTIFY_COOLDOWN": "5ms", "OTHER_MAXINFLIGHT": "1", "app_MIN_POLL_INTERVAL": "1s"}
	var environ []string
	for k, v := range env {
		environ = append(environ, k+"="+v)
	}
	_, err := subscriberConfigFromLookup("APP", environ, lookupIn(env))
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "APP_MAXINFLIGHT is not read (a misspelling?); use APP_MAX_IN_FLIGHT")
	require.ErrorContains(t, err, "APP_Lease is not read (a misspelling?); use APP_LEASE")
	if runtime.GOOS != "windows" { // where names ignore case, it is read
		require.ErrorContains(t, err, "app_MIN_POLL_INTERVAL is not read (a misspelling?); use APP_MIN_POLL_INTERVAL", "the prefix in other case")
	}
	require.NotContains(t, err.Error(), "DATABASE_URL")
	require.NotContains(t, err.Error(), "NOTIFY_COOLDOWN", "a publisher's variable beside the subscriber's")
	require.NotContains(t, err.Error(), "OTHER_")

	delete(env, "APP_MAXINFLIGHT")
	delete(env, "APP_Lease")
	delete(env, "app_MIN_POLL_INTERVAL")
	environ = environ[:0]
	for k, v := range env {
		environ = append(environ, k+"="+v)
	}
	c, err := subscriberConfigFromLookup("APP", environ, lookupIn(env))
	require.NoError(t, err)
	require.Equal(t, 8, c.MaxInFlight)
	_, err = publisherConfigFromLookup("APP", environ, lookupIn(env))
	require.NoError(t, err, "a subscriber's variables beside a publisher's")
}
