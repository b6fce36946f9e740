package owner

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

func TestStatStartTimeCountsFieldsAfterTheCommandName(t *testing.T) {
	// Field 2, the command, may hold spaces and parentheses.
	stat := "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 200 0 0 0\n"
	got, err := StatStartTime(stat)
	if err != nil || got != 987654 {
		t.Fatalf("StatStartTime = %d, %v; want 987654", got, err)
	}
	for _, bad := range []string{"no paren here", "1 (x) S 1 2"} {
		if _, err := StatStartTime(bad); err == nil {
			t.Errorf("StatStartTime(%q): want an error", bad)
		}
	}
}

func TestParseRoundTripsAndNamesTheVariable(t *testing.T) {
	o := Owner{pid: 17, startTime: 99}
	back, err := Parse(o.String())
	if err != nil || back != o {
		t.Fatalf("Parse(%q) = %v, %v", o.String(), back, err)
	}
	for _, bad := range []string{"", "17", "x:1", "0:1", "17:-1"} {
		_, err := Parse(bad)
		if err == nil {
			t.Errorf("Parse(%q): want an error", bad)
		} else if want := Env; !strings.Contains(err.Error(), want) {
			t.Errorf("Parse(%q) error %q does not name %s", bad, err, want)
		}
	}
}

func TestAliveTellsARunningProcessFromAnExitedOne(t *testing.T) {
	me, err := Of(os.Getpid())
	if err != nil || !me.Alive() {
		t.Fatalf("Of(self) = %v, %v; want alive", me, err)
	}
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	if _, err := Of(cmd.Process.Pid); err == nil {
		t.Errorf("Of(exited pid %d): want an error", cmd.Process.Pid)
	}
	recycled := Owner{pid: os.Getpid(), startTime: me.startTime + 1}
	if recycled.Alive() {
		t.Error("a PID whose start time differs must not count as the owner")
	}
}
