package pgoutboxui_test

import (
	"os"
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

func TestMain(m *testing.M) { os.Exit(pgoutboxtest.Run(m)) }
