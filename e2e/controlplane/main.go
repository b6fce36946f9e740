// Command kvtier-controlplane is one multi-call binary holding a real Kubernetes control plane for kvtier's
// tests and local demo: kube-apiserver (with etcd embedded in the same process), a controller manager running
// seven upstream controllers (controllers.go) and kubectl, all compiled from the published k8s.io/kubernetes
// v1.37 modules.
//
// One binary instead of four keeps the link step (the slowest single step on a 2-core machine) to one, and the
// packages the components share are compiled once. The mode is taken from the name it was called by
// (kubectl, kube-apiserver, kube-controller-manager, as symlinks in the cache directory) or from the first
// argument (kvtier-controlplane up|kubectl|kube-apiserver|kube-controller-manager ...).
package main

import (
	"fmt"
	"os"
	"path/filepath"
	_ "time/tzdata" // CronJob time zones, as the upstream mains do.

	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserverapp "k8s.io/kubernetes/cmd/kube-apiserver/app"

	"kvtier.io/e2e/controlplane/internal/owner"

	_ "k8s.io/client-go/plugin/pkg/client/auth"
)

const usage = `usage: kvtier-controlplane MODE [ARGS...]

modes:
  up --dir DIR [--owner-pid PID]   run etcd + kube-apiserver (+ kube-controller-manager) until stopped
  kubectl ARGS...                  kubectl
  kube-apiserver ARGS...           upstream kube-apiserver command
  kube-controller-manager ARGS...  the seven controllers the launcher runs (see controllers.go)
`

func main() {
	mode := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if mode == "kvtier-controlplane" {
		if len(args) == 0 {
			fmt.Fprint(os.Stderr, usage)
			os.Exit(2)
		}
		mode, args = args[0], args[1:]
	}
	// Child processes started by the launcher exit when the launcher does.
	owner.WatchFromEnv()
	os.Exit(runMode(mode, args))
}

func runMode(mode string, args []string) int {
	switch mode {
	case "up":
		return runUp(args)
	case "kubectl":
		return runKubectl(args)
	case "kube-apiserver":
		cmd := apiserverapp.NewAPIServerCommand()
		cmd.SetArgs(args)
		return cli.Run(cmd)
	case "kube-controller-manager":
		return runControllerManager(args)
	default:
		fmt.Fprintf(os.Stderr, "kvtier-controlplane: unknown mode %q\n%s", mode, usage)
		return 2
	}
}

func runKubectl(args []string) int {
	// Same steps as k8s.io/kubernetes/cmd/kubectl: read -v early so plugin and kuberc handling log at that level.
	os.Args = append([]string{"kubectl"}, args...)
	logs.GlogSetter(kubectlcmd.GetLogVerbosity(os.Args)) //nolint:errcheck
	command := kubectlcmd.NewDefaultKubectlCommand()
	if err := cli.RunNoErrOutput(command); err != nil {
		kubectlutil.CheckErr(err)
	}
	return 0
}
